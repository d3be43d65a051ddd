"""One alignment run, end to end: inputs, the HF reference and noise floor, the side under test,
the verdict, and (with ``ablate``) each known source of difference switched on and off.

What ``mpatch align`` runs; the report writer (``align.report``) turns the returned dict into files.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import psutil
import torch

from megatron_patch.align import ablations
from megatron_patch.align.capture import streams_like
from megatron_patch.align.points import ROUTING, captured_point_names
from megatron_patch.align.metrics import compare, compare_logits
from megatron_patch.align.parity import fp64_unaffordable
from megatron_patch.align.runner import McoreRun, capture_hf_dir, capture_mcore_runs
from megatron_patch.align.verdict import DEFAULT_TOLERANCE, exact_routing_layers, judge, judged_point_names
from megatron_patch.checkpoint.arch_source import open_checkpoint
from megatron_patch.checkpoint.hf_reader import checked_arch
from megatron_patch.dtypes import PRECISIONS
from megatron_patch.errors import UserError
from megatron_patch.input_files import read_input_text
from megatron_patch.lora.peft_io import read_peft_adapter
from megatron_patch.lora.sources import is_peft_folder
from megatron_patch.lora.state import find_base
from megatron_patch.models.blocks.float8_plan import arch_gemms, check_filter_kinds, cpu_recipe_problem, filter_text
from megatron_patch.models.description.arch import default_expert_tp, validate_layout
from megatron_patch.models.description.registry import get_family, parse_arch
from megatron_patch.runtime.distributed import ParallelLayout
from megatron_patch.runtime.machine import (TORCHAO_REINSTALL, cpu_float8_rowwise, installed_version,
                                            torchao_import_error)
from megatron_patch.tokenizer import load_tokenizer

# megatron-core (2.3 s to import after torch on 2 cores) is imported inside the functions that use it: the
# processes that import this module without building a megatron-core model (align's main process, the
# launcher's dry run and resume checks) do not pay for it.

# Fields that make two configs different *models*; any other difference is reported, not refused
# (a wrong RoPE scaling in a converted checkpoint is exactly what the verdict must catch).
STRUCTURE = ("family", "vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_heads", "num_kv_heads",
             "head_dim", "num_experts", "moe_topk", "moe_ffn_hidden_size", "shared_expert_ffn_hidden_size")
# config.json keys that say nothing about the computation.
IGNORED_CONFIG_KEYS = {"torch_dtype", "dtype", "transformers_version", "_name_or_path", "architectures",
                       "use_cache", "output_router_logits"}


@dataclass
class AlignSettings:
    hf_dir: str
    mcore_dir: str | None = None
    hf_dir_2: str | None = None
    layout: ParallelLayout = ParallelLayout()
    dtype: str = "bf16"
    seq_len: int = 128
    batch: int = 2
    seed: int = 0
    text_file: str | None = None
    ablate: bool = False
    tolerance: float = DEFAULT_TOLERANCE
    # Run only ``dtype``, without the fp32 run that certifies the conversion first.
    only_dtype: bool = False
    # A peft LoRA adapter: the reference is peft's model of hf_dir with it, MCore carries the same adapters.
    peft_dir: str | None = None
    # Check --mcore-dir's files against its manifest before loading them (--no-verify: False).
    verify: bool = True
    # The base a LoRA run in --mcore-dir was trained on, where it is no longer where the run recorded it
    base_dir: str | None = None
    # --dtype fp8: torchao's float8 recipe and filter, on both sides (docs/fp8.md)
    fp8_recipe: str = "tensorwise"
    fp8_filter: str | tuple = "auto"

    @property
    def fp8(self) -> tuple | None:
        return (self.fp8_recipe, self.fp8_filter) if self.dtype == "fp8" else None

    @property
    def test_side(self) -> str:
        return "HF (second folder)" if self.hf_dir_2 else "MCore"

    @property
    def runs(self) -> tuple[str, ...]:
        """The dtypes the tested side runs in: fp32 first (it certifies the conversion: a correct one agrees to
        fp32 rounding, and faults below bf16's rounding show), then the dtype asked for."""
        if self.dtype == "fp32" or self.only_dtype:
            return (self.dtype,)
        return ("fp32", self.dtype)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(a: dict, b: dict) -> list[dict]:
    # ignored at any depth: a multimodal config.json has a dtype in each sub-config (text_config.dtype), which a
    # folder saved again in another dtype changes (the align audit: the same weights were "another model")
    fa = {k: v for k, v in _flatten(a).items() if k.split(".")[-1] not in IGNORED_CONFIG_KEYS}
    fb = {k: v for k, v in _flatten(b).items() if k.split(".")[-1] not in IGNORED_CONFIG_KEYS}
    return [{"key": k, "reference": fa.get(k), "tested": fb.get(k)}
            for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def _test_arch(s: AlignSettings):
    if s.mcore_dir:
        # A checkpoint of another tool is read as the model of --hf-dir, checked against its tensors.
        opened = open_checkpoint(s.mcore_dir, hf_config=s.hf_dir, config_option="--hf-dir", family_option=None)
        return opened.model_arch, opened.sidecar
    return parse_arch(s.hf_dir_2 or s.hf_dir), None


def _check_lora_base(s: AlignSettings, sidecar) -> None:
    """A LoRA run's base (or --base-dir's), checked by digest before any rank process starts."""
    record = ((sidecar.lora or {}) if sidecar is not None else {}).get("base")
    if record:
        find_base(record, s.base_dir, s.mcore_dir, "--base-dir")
    elif s.base_dir is not None:
        raise UserError(f"--base-dir names the base of a LoRA run's checkpoint given as --mcore-dir, and "
                        f"{s.mcore_dir or 'no --mcore-dir'} is none")


def check_run_fits(arch, batch: int, seq_len: int, command: str) -> None:
    """Refuse, before any model is built, a run whose inputs the model was not made for or whose activations
    (logits of each side, the captured layer outputs, attention scores: a rough upper estimate) would not fit
    in this machine's free memory."""

    if seq_len > arch.max_position_embeddings:
        raise UserError(f"--seq-len {seq_len:,} is beyond the model's {arch.max_position_embeddings:,} positions "
                        "(max_position_embeddings): choose a shorter --seq-len")
    tokens = batch * seq_len
    # + the embedding of every id ([vocab, hidden]) each of the four captures holds
    need = 4 * (4 * tokens * arch.vocab_size + 8 * tokens * arch.hidden_size * (arch.num_layers + 2)
                + batch * arch.num_heads * seq_len * seq_len + 4 * arch.vocab_size * arch.hidden_size)
    free = psutil.virtual_memory().available
    if need > free:
        raise UserError(f"{command} of --batch {batch:,} x --seq-len {seq_len:,} needs about {need / 2**30:,.1f} GiB "
                        f"for its activations; {free / 2**30:.1f} GiB are free: lower --batch or --seq-len")


def _check_some_gemm_in_float8(s: AlignSettings, arch) -> None:
    """An fp8 verdict where the filter left every GEMM in bf16 would certify bf16 under fp8's name (torchao's auto
    filter keeps every GEMM of a small model in bf16; on a GPU, shards that are no multiple of 16 stay in bf16)."""
    cuda = torch.cuda.is_available()
    if s.fp8_filter != "auto" and not cuda:  # a kind list the model has (checked) or all: float8 GEMMs on a CPU
        return
    gemms = arch_gemms(arch, s.fp8_recipe, s.fp8_filter, (s.layout.tp, s.layout.expert_tp) if cuda else None)
    if not any(g.float8 for layer in gemms.values() for g in layer):
        raise UserError(f"--fp8-filter {filter_text(s.fp8_filter)} ({s.fp8_recipe}) leaves every decoder GEMM of "
                        "this model in bf16, so nothing would be compared in float8: use --fp8-filter all (or a "
                        "list of kinds), or --dtype bf16")


def validate(s: AlignSettings):
    """Every check that needs no model run; returns (reference arch, tested arch, sidecar or None)."""
    if not Path(s.hf_dir).is_dir():
        raise UserError(f"--hf-dir {s.hf_dir} is not a folder: point it at a Hugging Face model folder")
    if s.mcore_dir and s.hf_dir_2:
        raise UserError("give either --mcore-dir (HF vs MCore) or --hf-dir-2 (HF vs HF), not both")
    if s.hf_dir_2 and not Path(s.hf_dir_2).is_dir():
        raise UserError(f"--hf-dir-2 {s.hf_dir_2} is not a folder: point it at a Hugging Face model folder")
    if s.dtype not in PRECISIONS and s.dtype != "fp8":
        raise UserError(f"--dtype {s.dtype} is not one of {', '.join(PRECISIONS)}, fp8")
    if s.dtype == "fp8" and (s.hf_dir_2 or s.peft_dir or s.ablate):
        raise UserError("--dtype fp8 compares MCore's float8 with torchao's on the HF model: without --hf-dir-2, "
                        "--peft-dir and --ablate")
    if s.dtype == "fp8" and installed_version("torchao") is None:  # the [fp8] extra, not in a plain install
        raise UserError(f"--dtype fp8 runs torchao's float8, and torchao is not installed in {sys.executable}: "
                        "pip install -e \".[fp8]\" in megatron_patch's repository (or pip install torchao), or "
                        "choose another --dtype")
    if s.dtype == "fp8" and (unusable := torchao_import_error()):  # an internal error after the fp32 run (fdoc audit)
        raise UserError(f"--dtype fp8 runs torchao's float8, and the torchao installed cannot run it ({unusable}): "
                        f"{TORCHAO_REINSTALL}, or choose another --dtype")
    if s.dtype == "fp8" and not torch.cuda.is_available():
        problem = cpu_recipe_problem(s.fp8_recipe, cpu_float8_rowwise(), torch.__version__,
                                     f"--fp8-recipe {s.fp8_recipe}")
        if problem:
            raise UserError(problem)
    if s.seq_len < 2 or s.batch < 1:
        raise UserError(f"--seq-len must be >= 2 and --batch >= 1 (got {s.seq_len}, {s.batch})")
    if not math.isfinite(s.tolerance) or s.tolerance <= 1:
        raise UserError(f"--tolerance must be a finite number > 1 (a multiple of HF's own rounding error), "
                        f"got {s.tolerance}")
    if s.ablate and s.hf_dir_2:
        raise UserError("--ablate switches MCore implementation details: it needs the MCore side, not --hf-dir-2")
    if s.hf_dir_2 and s.layout != ParallelLayout():  # it ran whole and said nothing (the align audit)
        raise UserError(f"--tp/--pp/--ep/--etp split the MCore side, and --hf-dir-2 runs two HF models whole: drop "
                        f"them (got {s.layout})")
    if not s.verify and not s.mcore_dir:
        raise UserError("--no-verify skips checking --mcore-dir's files against its manifest, and there is no "
                        "--mcore-dir: drop it")
    if s.only_dtype and s.dtype == "fp32":
        raise UserError("--only-dtype skips the fp32 run before another --dtype: with --dtype fp32 there is only one run")
    if s.peft_dir:
        if s.hf_dir_2:
            raise UserError("--peft-dir puts the adapter on both sides of HF vs MCore: drop --hf-dir-2")
        if not is_peft_folder(s.peft_dir):
            raise UserError(f"--peft-dir {s.peft_dir} is not a peft adapter folder (it has no adapter_config.json)")
    ref_arch = checked_arch(s.hf_dir, shapes=True)
    check_run_fits(ref_arch, s.batch, s.seq_len, "align")
    if s.dtype == "fp8":
        check_filter_kinds(ref_arch, s.fp8_filter, "--fp8-filter")
        no_floor = get_family(ref_arch.family).fp8_align_refused
        if no_floor:
            raise UserError(f"--dtype fp8 has no HF floor for {ref_arch.family}: {no_floor}; compare --dtype bf16 "
                            "(training with PR=fp8 is not affected)")
        _check_some_gemm_in_float8(s, ref_arch)
    if s.hf_dir_2:
        checked_arch(s.hf_dir_2, shapes=True)
    test_arch, sidecar = _test_arch(s)
    _check_lora_base(s, sidecar)
    if s.peft_dir:
        read_peft_adapter(s.peft_dir, ref_arch)  # refused in one line if it does not fit the model
    diff = [f for f in STRUCTURE if getattr(ref_arch, f) != getattr(test_arch, f)]
    if diff:
        what = ", ".join(f"{f} {getattr(ref_arch, f)} vs {getattr(test_arch, f)}" for f in diff)
        raise UserError(f"the two sides are different models ({what}): compare a checkpoint with the HF folder it came from")
    if not s.hf_dir_2:
        # the expert-tensor-parallel size hf2mcore takes where none is given (gpt_oss's biased experts: ETP=1)
        s.layout, note = default_expert_tp(test_arch, s.layout)
        if note:  # said under --quiet too, as hf2mcore says it: the layout run is not the one asked for
            print(f"align: {note}", file=sys.stderr, flush=True)
        validate_layout(test_arch, s.layout, uneven_pipelines=False)
        if sidecar is not None and sidecar.checkpoint_format == "legacy":
            ck = sidecar.parallel_layout
            if (ck.tp, ck.pp, ck.ep, ck.expert_tp) != (s.layout.tp, s.layout.pp, s.layout.ep, s.layout.expert_tp):
                raise UserError(f"{s.mcore_dir} is a legacy checkpoint for {ck}: pass that layout (--tp/--pp/--ep), "
                                "or convert with --format torch_dist, which loads at any layout")
    return ref_arch, test_arch, sidecar


def make_tokens(s: AlignSettings, vocab_size: int) -> tuple[torch.Tensor, str]:
    """[batch, seq_len] token ids: seeded random ones, or real text through the checkpoint's tokenizer."""
    if not s.text_file:
        gen = torch.Generator().manual_seed(s.seed)
        return torch.randint(0, vocab_size, (s.batch, s.seq_len), generator=gen), f"random tokens (seed {s.seed})"
    path = Path(s.text_file)
    if not path.exists():
        raise UserError(f"--text-file {path} not found")
    text = read_input_text(path)
    tokenizer_file = Path(s.hf_dir) / "tokenizer.json"
    if not (tokenizer_file.exists() or tokenizer_file.is_symlink()):
        raise UserError(f"--text-file needs a tokenizer.json in {s.hf_dir}: copy the tokenizer files there or use "
                        "random tokens")
    # The tokenizer preprocess and SFT use: tokenizer.json read and parsed here, never code from the folder
    # (transformers' AutoTokenizer would run a folder's auto_map tokenizer once its prompt is answered).
    ids = load_tokenizer(s.hf_dir).encode(text)
    need = s.batch * s.seq_len
    if len(ids) < need:
        raise UserError(f"{path} has {len(ids)} tokens; --batch {s.batch} x --seq-len {s.seq_len} needs {need}: "
                        "use a longer text or smaller --batch/--seq-len")
    tokens = torch.tensor(ids[:need]).view(s.batch, s.seq_len)
    if int(tokens.max()) >= vocab_size:
        raise UserError(f"the tokenizer in {s.hf_dir} yields ids beyond the model's vocabulary ({vocab_size})")
    return tokens, f"text from {path.name} ({need} tokens)"


def _point_series(ref, test, num_layers) -> list[float]:
    """rel_l2 at each point the verdict judges (the report plots them on its axis)."""
    return [compare(streams_like(ref[n], test[n]), test[n])["rel_l2"] for n in judged_point_names(ref, num_layers)]


def _ablation_rows(s, ref, floor, baseline, variants, num_layers, arch) -> list[dict]:
    same_dtype_ref = floor if floor is not None else ref
    base = compare_logits(ref["logits"], baseline["logits"])
    base_diff = compare(same_dtype_ref["logits"], baseline["logits"])["rel_l2"]
    floor_err = compare(ref["logits"], floor["logits"])["rel_l2"] if floor is not None else None
    rows = [{"name": "baseline", "source": "-", "change": "the model as megatron_patch builds it", "status": "ran",
             "logits_rel_l2": base["rel_l2"], "logits_kl": base["kl"], "diff_to_hf_same_dtype": base_diff,
             "ratio_to_floor": base["rel_l2"] / floor_err if floor_err else None, "change_vs_baseline": 0.0,
             "series": _point_series(ref, baseline, num_layers)}]
    for ab in ablations.ABLATIONS:
        row = {"name": ab.name, "source": ab.source, "change": ab.change}
        if ab.name not in variants:
            rows.append({**row, "status": "skipped", "reason": ablations.skip_reason(ab, arch) or "not run"})
            continue
        cap = variants[ab.name]
        if isinstance(cap, str):  # it would change nothing in this model (ablations.NotApplicable)
            rows.append({**row, "status": "skipped", "reason": cap})
            continue
        m = compare_logits(ref["logits"], cap["logits"])
        rows.append({**row, "status": "ran", "logits_rel_l2": m["rel_l2"], "logits_kl": m["kl"],
                     "diff_to_hf_same_dtype": compare(same_dtype_ref["logits"], cap["logits"])["rel_l2"],
                     "ratio_to_floor": m["rel_l2"] / floor_err if floor_err else None,
                     "change_vs_baseline": (m["rel_l2"] - base["rel_l2"]) / max(base["rel_l2"], 1e-30),
                     "series": _point_series(ref, cap, num_layers)})
    return rows


def run_alignment(s: AlignSettings, log: Callable[[str], None] | None = None) -> dict:
    """Run both sides, judge, and return every number (the content of report.json)."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    started = time.time()
    ref_arch, test_arch, sidecar = validate(s)
    tokens, token_source = make_tokens(s, ref_arch.vocab_size)

    peft = f" with the LoRA adapter {s.peft_dir} (peft)" if s.peft_dir else ""
    log(f"[1/3] HF fp32 reference{peft}{' and HF ' + s.dtype + ' noise floor' if s.dtype != 'fp32' else ''} "
        f"on {token_source}, batch {s.batch} x {s.seq_len}")
    ref = capture_hf_dir(s.hf_dir, tokens, "fp32", s.peft_dir)
    floor = capture_hf_dir(s.hf_dir, tokens, s.dtype, s.peft_dir, s.fp8) if s.dtype != "fp32" else None

    variants: dict = {}
    if s.hf_dir_2:
        log(f"[2/3] HF {' then '.join(s.runs)} from {s.hf_dir_2}")
        tests = {dt: capture_hf_dir(s.hf_dir_2, tokens, dt) for dt in s.runs}
    else:
        source = {"mcore_dir": s.mcore_dir, "hf_dir": s.hf_dir} if s.mcore_dir else {"hf_dir": s.hf_dir}
        source.update(peft_dir=s.peft_dir, verify=s.verify, base_dir=s.base_dir)
        runs = [McoreRun(dt, **source, fp8=s.fp8 if dt == "fp8" else None) for dt in s.runs]
        if s.ablate:
            runs += [McoreRun(s.dtype, ablation=a.name, **source)
                     for a in ablations.ABLATIONS if ablations.skip_reason(a, test_arch) is None]
        log(f"[2/3] MCore {' then '.join(s.runs)} at {s.layout} in {s.layout.world_size} process(es): {len(runs)} "
            "model run(s)" + (" (baseline + ablations; the fused SwiGLU variant compiles first)" if s.ablate else ""))
        captures = capture_mcore_runs(s.layout, tokens, runs)
        tests = dict(zip(s.runs, captures))
        variants = {r.ablation: c for r, c in zip(runs[len(s.runs):], captures[len(s.runs):])}
    test = tests[s.dtype]

    log("[3/3] verdict")
    verdicts = {dt: judge(ref, tests[dt], dt, ref_arch.num_layers, floor if dt != "fp32" else None, s.tolerance,
                          what=s.test_side, exact_routing=exact_routing_layers(ref_arch)) for dt in s.runs}
    if "fp32" in verdicts and not verdicts["fp32"].aligned:
        verdicts["fp32"] = _judged_on_fp32_floor(s, ref, tests["fp32"], tokens, ref_arch, verdicts["fp32"], log)
    verdict = combined_verdict(verdicts, s)
    unreached = input_coverage(ref, ref_arch)
    if unreached and verdict["aligned"]:
        verdict["summary"] += f" [{unreached}]"
    verdict["coverage"] = unreached
    differences = config_differences(ref_arch.hf_config, test_arch.hf_config)
    _fail_on_config_differences(verdict, differences, s)
    shown = verdict["dtype"]  # the run whose numbers the report's tables hold (combined_verdict)
    result = {
        "verdict": verdict,
        "settings": {**asdict(s), "layout": {"tp": s.layout.tp, "pp": s.layout.pp, "ep": s.layout.ep,
                                             "etp": s.layout.etp}},
        "inputs": {"tokens": token_source, "batch": s.batch, "seq_len": s.seq_len},
        "model": {"family": ref_arch.family, "num_layers": ref_arch.num_layers, "hidden_size": ref_arch.hidden_size,
                  "vocab_size": ref_arch.vocab_size, "num_experts": ref_arch.num_experts},
        "compared": {"reference": f"HF fp32 ({s.hf_dir})",
                     "floor": f"HF fp64 ({s.hf_dir})" if verdict.get("fp32_floor") else
                              (f"HF {shown} ({s.hf_dir})" + (f" after torchao's convert_to_float8_training "
                                                              f"({s.fp8_recipe}, filter {filter_text(s.fp8_filter)})"
                                                              if s.fp8 else ""))
                     if floor is not None and shown != "fp32" else None,
                     "tested": (f"HF {shown} ({s.hf_dir_2})" if s.hf_dir_2 else
                                f"MCore {shown} at {s.layout} from "
                                + (f"checkpoint {s.mcore_dir} ({sidecar.checkpoint_format})" if s.mcore_dir
                                   else f"{s.hf_dir} (in-memory mapping)") + peft)},
        "config_differences": differences,
        "ablations": _ablation_rows(s, ref, floor, test, variants, ref_arch.num_layers, test_arch) if s.ablate else [],
        # fp8: the points where MCore's float8 model equals torchao's on the HF model bit for bit
        "fp8_identical_points": [n for n in captured_point_names(test, ref_arch.num_layers) if n in test and n in floor
                                 and torch.equal(test[n], floor[n])] if s.fp8 else None,
        # what the tested MCore side's attention was (the runner builds the baseline with exactly this)
        "attention": None if s.hf_dir_2 else ablations.describe_baseline_attention(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "seconds": round(time.time() - started, 1),
    }
    return result


def _judged_on_fp32_floor(s: AlignSettings, ref, test, tokens, arch, verdict, log):
    """The fp32 run judged again, after it went over the fixed bound, with transformers' own fp32 rounding (HF fp64
    against HF fp32, per point) as a floor: fp32 rounding adds up with depth, and a correct 12-layer Qwen3-Next went
    over 1e-5 at layer 4, transformers' own fp32 run 3.7e-5 off its fp64 one (the cfg audit). Run only then: the
    fp64 model takes twice fp32's memory, and the bound it gives is never below the fixed one, so the verdict is the
    one running it always would give. Without the memory for it, the fixed bound's verdict stands, saying so."""
    unaffordable = fp64_unaffordable(s.hf_dir)
    if unaffordable:
        verdict.summary += (f" [transformers' own fp32 rounding, which deep models' fp32 error can pass 1e-5 within, "
                            f"was not measured: {unaffordable}]")
        return verdict
    log(f"[3/3] fp32 over the fixed bound at {verdict.first_failure}: HF fp64, for transformers' own fp32 rounding")
    fp64 = capture_hf_dir(s.hf_dir, tokens, "fp64", s.peft_dir)
    return judge(ref, test, "fp32", arch.num_layers, fp64, s.tolerance, what=s.test_side,
                 exact_routing=exact_routing_layers(arch))


# What a run in bf16 / fp16 alone cannot see: faults whose effect is below that dtype's rounding (measured
# by planting them in correct checkpoints: docs/alignment.md).
UNRESOLVED = ("faults smaller than {dtype} rounding (a 0.1% norm scale, one weight element off by a standard "
              "deviation, two swapped vocabulary rows) pass unseen; run without --only-dtype to certify the "
              "conversion in fp32 first")


def input_coverage(ref: dict, arch) -> str | None:
    """What of the model the run leaves unexercised, in words (None: nothing). The embedding's every row is compared
    (``EVERY_ID``), and every expert through the forced routing (``EVERY_EXPERT``), which sends batch x seq x top-k
    token slots to the experts in turn: fewer slots than experts leave the rest unseen."""
    slots = next((ids.numel() for name, ids in ref.items() if name.startswith(ROUTING)), None)
    if slots is None or slots >= arch.num_experts:
        return None
    return (f"the forced routing reaches {slots} of the {arch.num_experts} experts of each MoE layer (batch x seq-len "
            "x top-k): a fault in the rest is not seen here; a larger --batch or --seq-len reaches them all")


# config.json keys that name tokens, not anything the forward pass computes: a difference there is reported only
TOKEN_ID_KEYS = {"bos_token_id", "eos_token_id", "pad_token_id"}


def _fail_on_config_differences(verdict: dict, differences: list[dict], s: AlignSettings) -> None:
    """A tested model whose config says another model than --hf-dir's is not aligned, whatever these inputs showed:
    a gpt-oss checkpoint whose sidecar says sliding_window 4096 for 128 agreed on 128 tokens, and was certified
    (the adoc audit; at 256 tokens it failed at layers.0.attention)."""
    telling = [d for d in differences if d["key"].split(".")[-1] not in TOKEN_ID_KEYS]
    if not telling or not verdict["aligned"]:
        return
    shown = "; ".join(f"{d['key']}: {d['reference']} -> {d['tested']}" for d in telling[:3])
    verdict.update(aligned=False, decided_by="config", summary=(
        f"NOT aligned: the {s.test_side} model's config describes another model than --hf-dir's ({shown}"
        f"{'; ...' if len(telling) > 3 else ''}), which these inputs did not reach: its every compared output agreed"))


def combined_verdict(verdicts: dict, s: AlignSettings) -> dict:
    """One verdict over the runs, saying which decided it (``decided_by``: a dtype, or "both" where every run is
    aligned, as the summary says). The report's points (``dtype``) are the first failed run's (fp32 before the
    training dtype), else the training dtype's precision picture."""
    failed = [dt for dt in verdicts if not verdicts[dt].aligned]
    shown = failed[0] if failed else s.dtype
    out = verdicts[shown].to_dict()
    runs = {dt: {"aligned": v.aligned, "summary": v.summary, "first_failure": v.first_failure}
            for dt, v in verdicts.items()}
    out.update(decided_by="both" if len(verdicts) > 1 and not failed else shown, runs=runs)
    if len(verdicts) == 1:
        if s.only_dtype:
            out["summary"] += f" [{s.dtype} only (--only-dtype): {UNRESOLVED.format(dtype=s.dtype)}]"
        return out
    if not failed:
        out["summary"] = (f"{verdicts[s.dtype].summary} [decided by both runs: {_certifies(verdicts['fp32'])} "
                          f"({verdicts['fp32'].summary.removesuffix(': aligned')}), and {s.dtype} is within its "
                          "rounding]")
    elif shown == "fp32":
        other = "aligned" if verdicts[s.dtype].aligned else "not aligned either"
        out["summary"] = (f"{verdicts['fp32'].summary} [decided by the fp32 run, which resolves what {s.dtype} rounding "
                          f"hides; the {s.dtype} run alone says {other}]")
    else:
        out["summary"] = f"{verdicts[s.dtype].summary} [decided by the {s.dtype} run; {_certifies(verdicts['fp32'])}]"
    out["aligned"] = not failed
    return out


def _certifies(fp32) -> str:
    """What the fp32 run certifies: the conversion, saying how many routing flips it allowed as fp32 near-ties (the
    router logits are compared themselves, ``layers.N.router``: a router fault fails there, whatever it moves)."""
    flips = sum(r.flipped for r in fp32.routing if r.kind == "routing")
    if not flips:
        return "fp32 certifies the conversion"
    return (f"fp32 certifies the conversion ({flips} routing flip(s) at fp32 near-ties, with router logits that agree; "
            "the tokens they reach are judged up to the flip)")
