"""LoRA on Megatron-Core against Hugging Face peft, both ways (docs/lora.md).

peft is the reference throughout: adapters are made by peft (random, non-zero), logits come from
``PeftModel.from_pretrained``, and training is compared with peft plus a plain ``torch.optim.AdamW`` loop.
The quick tests need no rank processes; the multi-process parity and the launcher runs are ``slow``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from megatron_patch.align.parity import random_tokens
from megatron_patch.convert.checkpoint import hf_to_mcore
from megatron_patch.lora.peft_io import peft_tensors, read_peft_adapter, write_peft_adapter
from megatron_patch.lora.plan import count_params, plan_sites
from megatron_patch.lora.spec import LoraSpec
from megatron_patch.models.description.registry import families, parse_arch
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
from megatron_patch.models.gemma4.config import TINY_MOE_CONFIG as TINY_GEMMA4_MOE
from megatron_patch.models.qwen3_5.config import TINY_DENSE_CONFIG
from megatron_patch.runtime import ParallelLayout
from tests.convert_helpers import run_cli
from tests.lora_helpers import (
    as_text_class, hf_logits, load_hf, make_peft_adapter, mcore_lora_logits, peft_logits, peft_training_reference, rel)

FAMILY_NAMES = list(families())
MOE = [f for f in FAMILY_NAMES if parse_arch(families()[f].tiny_config).is_moe]
FP32_FLOOR = 1e-5


class _Lazy(dict):
    """A dict whose values are made on first use (a quick test builds only the models it reads)."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        self[key] = self.make(key)
        return self[key]


VARIANTS = {  # a partial adapter (q_proj, v_proj); peft's per-module patterns with rsLoRA; modules_to_save
    "partial": ("llama3_1", dict(modules=["q_proj", "v_proj"])),
    "patterns": ("qwen2", dict(use_rslora=True, layers_to_transform=[1, 2], alpha_pattern={"o_proj": 11},
                               rank_pattern={"k_proj": 2, r"layers\.2\.mlp\.down_proj": 5})),
    "saved": ("llama3_1", dict(modules=["q_proj", "o_proj"], modules_to_save=["lm_head", "model.norm"])),
}


@pytest.fixture(scope="session")
def lora_models(tmp_path_factory):
    """Each family's tiny HF model and a random peft adapter of it on every module it adapts (routed experts
    through peft's target_parameters), plus the VARIANTS; each made when first read."""
    root = tmp_path_factory.mktemp("lora")
    hf = _Lazy(lambda f: make_tiny_hf_checkpoint(f, root / "hf" / f, seed=1))
    adapters = _Lazy(lambda f: make_peft_adapter(hf[f], root / "peft" / f))
    variants = _Lazy(lambda v: make_peft_adapter(hf[VARIANTS[v][0]], root / v, **VARIANTS[v][1]))
    # Gemma 4 with its MoE block: adapters on its attention and on the dense MLP beside the experts (the experts
    # take none here)
    moe_hf = _Lazy(lambda _: make_tiny_hf_checkpoint("gemma4", root / "hf" / "gemma4_moe", seed=1,
                                                     **TINY_GEMMA4_MOE))
    moe_adapter = _Lazy(lambda _: make_peft_adapter(moe_hf[0], root / "peft" / "gemma4_moe", experts=False))
    return {"root": root, "hf": hf, "adapters": adapters, "variants": variants,
            "gemma4_moe": lambda: (moe_hf[0], moe_adapter[0], moe_hf[0])}


# --- quick: the adapter's layout and peft's rules -------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama3_1", "qwen2_moe", "deepseek_v3", "minimax_m2", "qwen3_next", "gpt_oss",
                                    "deepseek_v4"])
def test_peft_folder_round_trips_byte_for_byte(lora_models, family, tmp_path):
    """Reading a peft folder and writing it back gives peft's own tensors bit for bit, and a config peft reads
    into the same adapter (the stacked experts' A/B layout and nesting included)."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    src = lora_models["adapters"][family]
    arch = parse_arch(lora_models["hf"][family])
    spec, tensors, saved = read_peft_adapter(src, arch)
    out = tmp_path / "out"
    out.mkdir()
    write_peft_adapter(out, plan_sites(arch, spec), spec, arch, tensors, saved)
    a, b = load_file(src / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    config = LoraConfig.from_pretrained(str(out))
    assert config.r == 3 and config.lora_alpha == 5 and config.bias == "none"


def test_fused_layers_keep_one_adapter_per_hf_module(lora_models):
    """linear_qkv carries q, k and v's adapters apart (three A's), linear_fc1 gate's and up's; a partial adapter
    (q_proj, v_proj) leaves k's rows of the fused layer without one; a routed expert's adapter is one A over its
    fused gate/up input and one B over both halves, as transformers 5 and peft stack them."""
    arch = parse_arch(lora_models["hf"]["llama3_1"])
    full = plan_sites(arch, read_peft_adapter(lora_models["adapters"]["llama3_1"], arch)[0])
    qkv = next(s for s in full if s.target == "qkv")
    assert [a.name.rsplit(".", 1)[1] for a in qkv.adapters] == ["q_proj", "k_proj", "v_proj"]
    fc1 = next(s for s in full if s.target == "fc1")
    assert [a.name.rsplit(".", 1)[1] for a in fc1.adapters] == ["gate_proj", "up_proj"]
    partial = plan_sites(arch, read_peft_adapter(lora_models["variants"]["partial"], arch)[0])
    qkv = next(s for s in partial if s.target == "qkv")
    assert [a.name.rsplit(".", 1)[1] for a in qkv.adapters] == ["q_proj", "v_proj"]
    assert qkv.covering(1) is None and qkv.covering(2) == (1, 0)
    assert {s.target for s in partial} == {"qkv"}
    moe = parse_arch(lora_models["hf"]["qwen2_moe"])
    expert = next(s for s in plan_sites(moe, read_peft_adapter(lora_models["adapters"]["qwen2_moe"], moe)[0])
                  if s.target == "experts")
    (a,) = expert.adapters
    assert a.name.endswith("mlp.experts.gate_up_proj") and a.parts == (0, 1) and a.shape_b == (sum(a.rows), 3)


def test_peft_rules_for_rank_alpha_layers_and_rslora(lora_models):
    """rank_pattern, alpha_pattern, layers_to_transform and use_rslora give each module the rank and scaling
    peft's own LoraModel gives it."""
    from peft import PeftModel

    adapter = lora_models["variants"]["patterns"]
    arch = parse_arch(lora_models["hf"]["qwen2"])
    spec = read_peft_adapter(adapter, arch)[0]
    ours = {a.name: (a.rank, spec.scaling(a.rank, a.alpha)) for s in plan_sites(arch, spec) for a in s.adapters}
    model = PeftModel.from_pretrained(load_hf(lora_models["hf"]["qwen2"]), str(adapter))
    theirs = {name.removeprefix("base_model.model."): (m.r["default"], m.scaling["default"])
              for name, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    assert ours.keys() == theirs.keys() and all(n.split(".")[2] in ("1", "2") for n in ours)
    for name in ours:
        assert ours[name][0] == theirs[name][0] and ours[name][1] == pytest.approx(theirs[name][1], rel=1e-12), name
    assert {r for r, _ in ours.values()} == {2, 3, 5}


def test_a_module_named_in_full_takes_its_adapter_outside_layers_to_transform(lora_models, tmp_path):
    """peft applies layers_to_transform to the modules target_modules names by their last parts only: one named in
    full (or by a regular expression) takes its adapter in any layer. Such an adapter, saved by peft and loaded by
    it, was refused as "outside its adapter_config.json's layers_to_transform"."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file

    from megatron_patch.errors import UserError

    hf = lora_models["hf"]["llama3_1"]
    full_name = "model.layers.0.mlp.down_proj"
    peft_model = get_peft_model(load_hf(hf), LoraConfig(r=3, lora_alpha=5, layers_to_transform=[1],
                                                        target_modules=["q_proj", full_name]))
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    peft_model.save_pretrained(str(tmp_path / "peft"))
    arch = parse_arch(hf)
    spec, tensors, _ = read_peft_adapter(tmp_path / "peft", arch)
    ours = {a.name for s in plan_sites(arch, spec) for a in s.adapters}
    model = PeftModel.from_pretrained(load_hf(hf), str(tmp_path / "peft"))
    theirs = {name.removeprefix("base_model.model.") for name, m in model.named_modules()
              if hasattr(m, "lora_A") and "default" in m.lora_A}
    assert ours == theirs == {"model.layers.1.self_attn.q_proj", full_name}
    assert set(peft_tensors(plan_sites(arch, spec), tensors)) == set(load_file(tmp_path / "peft"
                                                                              / "adapter_model.safetensors"))
    # the same module named by its last parts stays within layers_to_transform, as in peft
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "down_proj"]
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=rf"holds an adapter on {full_name}, outside its adapter_config.json's "
                                        r"layers_to_transform \[1\]"):
        read_peft_adapter(tmp_path / "peft", arch)


@pytest.mark.parametrize("family, expert_module, projections", [
    ("mixtral", "block_sparse_moe.experts.{e}", ("w1", "w3", "w2")),
    ("qwen3_moe", "mlp.experts.{e}", ("gate_proj", "up_proj", "down_proj")),
])
def test_transformers4_expert_adapters_join_as_peft_joins_them(family, expert_module, projections, tmp_path):
    """An adapter made with transformers 4 (one LoRA per expert's gate, up and down projections) is joined per
    expert into the stacked form exactly as peft's own weight conversion joins it when transformers 5 loads it
    (peft 0.21 converts these for Mixtral and the Qwen2-MoE-like models it maps, not for qwen2_moe itself)."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    hf = make_tiny_hf_checkpoint(family, tmp_path / "hf")
    arch = parse_arch(hf)
    gen = torch.Generator().manual_seed(3)
    shapes = dict(zip(projections, [(arch.moe_ffn_hidden_size, arch.hidden_size)] * 2
                      + [(arch.hidden_size, arch.moe_ffn_hidden_size)]))
    tensors = {}
    for layer in [i for i in range(arch.num_layers) if arch.is_moe_layer(i)]:
        for e in range(arch.num_experts):
            for proj, (rows, cols) in shapes.items():
                name = f"base_model.model.model.layers.{layer}.{expert_module.format(e=e)}.{proj}"
                tensors[f"{name}.lora_A.weight"] = torch.randn(2, cols, generator=gen) * 0.1
                tensors[f"{name}.lora_B.weight"] = torch.randn(rows, 2, generator=gen) * 0.1
    v4 = tmp_path / "v4"
    v4.mkdir()
    save_file(tensors, v4 / "adapter_model.safetensors")
    (v4 / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 6, "target_modules": list(projections), "bias": "none",
         "task_type": "CAUSAL_LM"}))
    spec, ours, _ = read_peft_adapter(v4, arch)
    ours = peft_tensors(plan_sites(arch, spec), ours)
    model = PeftModel.from_pretrained(load_hf(hf), str(v4))
    theirs = {k: v for k, v in get_peft_model_state_dict(model).items() if ".experts." in k}
    assert set(ours) == set(theirs) and len(theirs) == 4 * (arch.num_layers - len(arch.dense_layers))
    for k in theirs:
        assert torch.equal(ours[k], theirs[k]), k
    tokens = random_tokens(arch.vocab_size, 2, 16)
    assert set(ours) and rel(hf_logits(hf, tokens), peft_logits(hf, v4, tokens)) > 1e-3  # the experts adapt


@pytest.mark.slow
def test_trainable_parameters_equal_peft_for_the_same_targets_and_rank():
    """The plan's trainable count equals peft's on every family for the same targets and rank (on the MoE types
    where peft reads gate/up/down as the experts, the dense and shared-expert MLPs are left out on both sides)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_patch.lora.peft_io import peft_reinterpreted
    from tests.lora_helpers import peft_targets

    from megatron_patch.models.shape.model_shape import model_shapes

    shapes = model_shapes([parse_arch(families()[f].tiny_config) for f in FAMILY_NAMES])  # one megatron-core start
    for family, shape in zip(FAMILY_NAMES, shapes):
        raw = families()[family].tiny_config
        arch = parse_arch(raw)
        mlp = () if peft_reinterpreted(raw["model_type"]) else ("fc1", "fc2", "shared_experts")
        targets = tuple(t for t in ("qkv", "proj", "experts", "indexer") + mlp if t in _groups(arch))
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw))
        peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, **peft_targets(arch)))
        ours = count_params(plan_sites(arch, LoraSpec(rank=4, alpha=8, targets=targets), shape))
        assert ours == peft.get_nb_trainable_parameters()[0], family


def _groups(arch):
    from megatron_patch.lora.plan import family_targets

    return family_targets(arch)


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["qwen2_moe", "saved"])
def test_peft_dir_checkpoint_exports_the_same_adapter(lora_models, adapter, tmp_path):
    """hf2mcore --peft-dir stores the adapters (and modules_to_save weights, in place of the base's) beside the
    weights; mcore2hf --lora-adapter gives back peft's tensors bit for bit."""
    from megatron_patch.cli import main
    from safetensors.torch import load_file

    src = lora_models["adapters"][adapter] if adapter in FAMILY_NAMES else lora_models["variants"][adapter]
    hf = lora_models["hf"]["qwen2_moe" if adapter == "qwen2_moe" else "llama3_1"]
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(ckpt), "--peft-dir", str(src), "--quiet"]) == 0
    assert main(["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(out), "--lora-adapter"]) == 0
    a, b = load_file(src / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # peft's AutoPeftModel loads the base this names: the HF folder, not the MCore checkpoint (no config.json)
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(hf.resolve())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "gpt_oss", "deepseek_v4"])
def test_new_family_adapters_export_and_merge_as_peft(lora_models, family, tmp_path):
    """Issue 23's families, and DeepSeek-V4, through the converter: hf2mcore --peft-dir, then --lora-adapter gives
    peft's tensors back bit for bit (Qwen3.5's under the hub class's model.language_model. names, DeepSeek-V4's
    under the names transformers loads the hub's as), and --merge-lora gives peft's merge_and_unload logits (gpt-oss:
    the transposed, interleaved experts; Qwen3-Next: the gated q rows and the Gated DeltaNet's fused input
    projections; DeepSeek-V4: merged into the hub's names)."""
    from megatron_patch.cli import main
    from safetensors.torch import load_file

    hf, src = lora_models["hf"][family], lora_models["adapters"][family]
    ckpt, out, merged = tmp_path / "ckpt", tmp_path / "out", tmp_path / "merged"
    assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(ckpt), "--peft-dir", str(src), "--quiet"]) == 0
    assert main(["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(out), "--lora-adapter"]) == 0
    a, b = load_file(src / "adapter_model.safetensors"), as_text_class(load_file(out / "adapter_model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(merged), "--merge-lora",
                 "--quiet"]) == 0
    tokens = random_tokens(200, batch=2, seq=16, seed=3)
    ours, peft_merged = hf_logits(merged, tokens), peft_logits(hf, src, tokens, merged=True)
    assert rel(ours, peft_merged) <= 1e-6 and rel(peft_merged, hf_logits(hf, tokens)) > 1e-2


@pytest.mark.slow
def test_merge_lora_into_a_narrower_dtype_rounds_once_as_the_cast_of_an_fp32_merge(lora_models, tmp_path):
    """--merge-lora --dtype bf16 of an fp32 base equals the bf16 cast of peft's fp32 merge bit for bit: the base
    weights are read in their own dtype, not from the bf16 export (which rounded them before the sum, one bf16 step
    off on about one element in seven)."""
    from megatron_patch.cli import main
    from peft import PeftModel
    from safetensors.torch import load_file

    hf, src = lora_models["hf"]["llama3_1"], lora_models["adapters"]["llama3_1"]
    ckpt, merged = tmp_path / "ckpt", tmp_path / "merged"
    assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(ckpt), "--peft-dir", str(src), "--quiet"]) == 0
    assert main(["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(merged), "--merge-lora",
                 "--dtype", "bf16", "--quiet"]) == 0
    base = load_hf(hf)
    assert next(base.parameters()).dtype == torch.float32
    reference = PeftModel.from_pretrained(base, str(src)).merge_and_unload().state_dict()
    ours = load_file(merged / "model.safetensors")
    assert set(ours) <= set(reference) and len(ours) > 10
    for name, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, reference[name].to(torch.bfloat16)), name
    # the check can tell: rounding the base first lands elsewhere on some elements of an adapted weight
    weight, w_fp32 = "model.layers.0.self_attn.q_proj.weight", load_file(hf / "model.safetensors")
    delta = reference[weight] - w_fp32[weight]
    rounded_first = (w_fp32[weight].to(torch.bfloat16).float() + delta).to(torch.bfloat16)
    assert not torch.equal(rounded_first, ours[weight])


@pytest.mark.slow
def test_merge_lora_onto_a_legacy_base_in_a_narrower_dtype_says_it_rounds_the_base_first(lora_models, tmp_path,
                                                                                       capsys):
    """A legacy base (a LoRA run may start from one) is merged as exported, W rounded to --dtype before the sum:
    said in one note naming the exact merge's --dtype, and the merged weight is that sum."""
    from megatron_patch.cli import main
    from megatron_patch.lora.state import base_record
    from safetensors.torch import load_file

    hf, src = lora_models["hf"]["llama3_1"], lora_models["adapters"]["llama3_1"]
    ckpt, legacy, merged = tmp_path / "ckpt", tmp_path / "legacy", tmp_path / "merged"
    assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(ckpt), "--peft-dir", str(src), "--quiet"]) == 0
    assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(legacy), "--format", "legacy",
                 "--quiet"]) == 0
    # the adapters' checkpoint made to name the legacy conversion as its base, as a run trained from it records
    sidecar = ckpt / "mpatch_checkpoint.json"
    record = json.loads(sidecar.read_text())
    record["lora"]["base"] = base_record(legacy)
    sidecar.write_text(json.dumps(record))
    capsys.readouterr()
    assert main(["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(merged), "--merge-lora",
                 "--dtype", "bf16", "--no-verify", "--quiet"]) == 0
    assert (f"note: the base {legacy} is a legacy checkpoint, whose weights are merged as exported in bf16: rounded "
            "before the adapters' product is added (--dtype fp32 is the exact merge)") in capsys.readouterr().err
    weight = "model.layers.0.self_attn.q_proj.weight"
    w_fp32 = load_file(hf / "model.safetensors")[weight]
    spec, tensors, _ = read_peft_adapter(src, parse_arch(hf))
    a, b = (tensors[f"lora.model.layers.0.self_attn.q_proj.lora_{x}"].float() for x in "AB")
    delta = spec.scaling(spec.rank, spec.alpha) * (b @ a)
    expected = (w_fp32.to(torch.bfloat16).float() + delta).to(torch.bfloat16)
    assert torch.equal(load_file(merged / "model.safetensors")[weight], expected)


# --- quick: bad input, one line, exit 2 -----------------------------------------------------------------------

def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("mpatch")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("edit, message", [
    ({"use_dora": True}, "DoRA (use_dora) is not supported"),
    ({"bias": "lora_only"}, "only bias=\"none\" adapters"),
    ({"peft_type": "IA3"}, "only LoRA adapters are supported"),
    ({"layers_pattern": "blocks"}, "layers_pattern 'blocks' is not supported"),
    # Python's json (and peft) reads NaN/Infinity: int() of them was an internal error, and an alpha of them
    # merged into NaN weights without a word.
    ({"r": float("inf")}, "r must be an integer, found inf"),
    ({"r": float("nan")}, "r must be an integer, found nan"),
    ({"rank_pattern": {"q_proj": float("nan")}}, "rank_pattern['q_proj'] must be a positive integer, found nan"),
    ({"lora_alpha": float("nan")}, "lora_alpha must be a finite number, found nan"),
    ({"lora_alpha": float("inf")}, "lora_alpha must be a finite number, found inf"),
    ({"alpha_pattern": {"q_proj": float("inf")}}, "alpha_pattern['q_proj'] must be a positive finite number, found inf"),
    # malformed target lists were internal errors (a TypeError)
    ({"target_modules": [{"a": 1}]}, "target_modules must be a regular expression or a list of module names"),
    ({"target_modules": 5}, "target_modules must be a regular expression or a list of module names, found 5"),
    ({"target_modules": "q_proj("}, "target_modules 'q_proj(' is not a regular expression"),
    ({"target_parameters": "experts"}, "target_parameters must be a list of parameter names, found experts"),
])
def test_unsupported_peft_configs_are_refused(lora_models, tmp_path, capsys, edit, message):
    adapter = tmp_path / "a"
    shutil.copytree(lora_models["adapters"]["llama3_1"], adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, **edit}))
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(lora_models["hf"]["llama3_1"]), "--save-dir",
                      str(tmp_path / "out"), "--peft-dir", str(adapter))
    assert rc == 2 and message in _one_line(err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, message", [
    ({"r": 8}, "adapter has rank 3, but its adapter_config.json gives it rank 8"),
    ({"rank_pattern": {"k_proj": 2}}, "k_proj's adapter has rank 3, but its adapter_config.json gives it rank 2"),
    ({"layers_to_transform": [0]}, "outside its adapter_config.json's layers_to_transform [0]"),
    ({"target_modules": ["q_proj"]}, "which its adapter_config.json does not target (target_modules ['q_proj'])"),
    ({"target_modules": r".*\.self_attn\..*"}, "mlp."),
], ids=["r", "rank_pattern", "layers_to_transform", "target_modules", "target_regex"])
def test_an_adapter_its_config_contradicts_is_refused(lora_models, tmp_path, capsys, edit, message):
    """peft builds the adapters its config describes, then loads the file: another rank is a size mismatch it
    refuses, and a module the config does not target is left out. Before, the tensors decided alone (a merge
    that was not peft's, a rank read as the config's scaling denominator, a checkpoint its own export refused)."""
    adapter = tmp_path / "a"
    shutil.copytree(lora_models["adapters"]["llama3_1"], adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 3 and not config.get("rank_pattern"), config  # what the edits contradict
    (adapter / "adapter_config.json").write_text(json.dumps({**config, **edit}))
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(lora_models["hf"]["llama3_1"]), "--save-dir",
                      str(tmp_path / "out"), "--peft-dir", str(adapter))
    assert rc == 2 and message in _one_line(err), err
    assert not (tmp_path / "out").exists()
    # the config as written still reads
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    assert run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(lora_models["hf"]["llama3_1"]), "--save-dir",
                   str(tmp_path / "out"), "--peft-dir", str(adapter))[0] == 0


def test_an_adapter_on_the_output_layer_is_refused_as_not_supported_yet(lora_models, tmp_path):
    """peft's LoRA on lm_head, made on this very model, was refused as "made for another base model" (the ldoc
    audit); docs/lora.md lists it as not supported yet, with modules_to_save the way on."""
    from megatron_patch.errors import UserError

    hf = lora_models["hf"]["llama3_1"]
    adapter = make_peft_adapter(hf, tmp_path / "peft", modules=["q_proj", "lm_head"])
    with pytest.raises(UserError, match=r"has an adapter on lm_head: LoRA on the output layer or the embedding is not "
                                        r"supported yet \(docs/lora.md\); train it whole with modules_to_save"):
        read_peft_adapter(adapter, parse_arch(hf))


def test_modules_to_save_match_as_peft_matches_them():
    """peft keeps a module when its name ends with a listed one (``key.endswith(name)``): "norm" is every *norm
    module, input_layernorm too. Matching only at a dot, the import refused such a peft adapter as made for another
    model (the ldoc audit)."""
    from megatron_patch.lora.saved import saved_rules
    from megatron_patch.models.description.tiny import tiny_config

    arch = parse_arch(tiny_config("llama3_1"))
    names = set(saved_rules(arch, ("lm_head", "norm")))
    layers = range(arch.num_layers)
    assert names == {"lm_head.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{kind}.weight" for i in layers for kind in ("input_layernorm", "post_attention_layernorm")}
    assert set(saved_rules(arch, ("model.norm",))) == {"model.norm.weight"}  # a longer name, fewer modules


@pytest.mark.parametrize("module", ["embed_tokens", "lm_head"])
def test_either_end_of_a_tied_embedding_in_modules_to_save_is_refused(lora_models, tmp_path, capsys, module):
    """peft trains a copy of the module named and keeps the other end of the tied pair as it was. embed_tokens was
    accepted, and the model and --merge-lora export used the trained embedding for the output layer too (logits
    1.55 from peft's merge); lm_head was refused with advice to name the embedding instead."""
    adapter = make_peft_adapter(lora_models["hf"]["qwen2"], tmp_path / "peft", modules=["q_proj"],
                                modules_to_save=[module])
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(lora_models["hf"]["qwen2"]), "--save-dir",
                      str(tmp_path / "out"), "--peft-dir", str(adapter))
    assert rc == 2 and "one end of this model's tied embedding and output layer" in _one_line(err), err
    assert not (tmp_path / "out").exists()


@pytest.fixture
def foreign_base(lora_models, tmp_path, monkeypatch):
    """A torch_dist base without this project's manifest (as another tool's), its record, and the digest cache."""
    from megatron_patch.lora.state import base_record

    monkeypatch.setenv("MPATCH_CACHE_DIR", str(tmp_path / "cache"))
    base = tmp_path / "base"
    hf_to_mcore(lora_models["hf"]["llama3_1"], base, ParallelLayout(), progress=False)
    (base / "mpatch_manifest.json").unlink()
    return base, base_record(base), tmp_path / "cache" / "digests"


def _find_base(record, given=None):
    from megatron_patch.errors import UserError
    from megatron_patch.lora.state import find_base

    with pytest.raises(UserError) as caught:
        find_base(record, given, "CK", "--base-dir")
    return str(caught.value)


def test_a_base_whose_metadata_was_edited_is_not_the_base(foreign_base):
    """The digest of a base without a manifest left out hidden files, torch_dist's .metadata among them, which says
    which bytes are which tensor: a .metadata whose layers 0 and 1 swapped their o_proj bytes passed the check, and
    --merge-lora exported other weights."""
    import pickle

    from megatron_patch.lora.state import find_base

    base, record, _ = foreign_base
    assert find_base(record, None, "CK", "--base-dir") == base
    path = base / "release" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    keys = [k for k in metadata.storage_data if k.fqn == "decoder.layers.self_attention.linear_proj.weight"]
    first, second = (next(k for k in keys if k.offset[0] == i) for i in (0, 1))
    metadata.storage_data[first], metadata.storage_data[second] = (metadata.storage_data[second],
                                                                   metadata.storage_data[first])
    path.write_bytes(pickle.dumps(metadata))
    assert f"{base} is not the base model CK was trained on" in _find_base(record)


def test_a_digest_of_the_older_format_still_finds_its_base_saying_what_it_leaves_unchecked(foreign_base, capsys):
    """A record of the older format (hidden files left out) is checked as it was made, so runs of an older version
    resume; that it cannot vouch for the .metadata is said. A wrong base is still refused."""
    from megatron_patch.lora.state import HIDDEN_FILES_LEFT_OUT, checkpoint_digest, find_base

    base, record, _ = foreign_base
    old = {**record, "digest": checkpoint_digest(base, HIDDEN_FILES_LEFT_OUT)}
    assert old["digest"].startswith("sha256-files-1:") and old["digest"] != record["digest"]
    assert find_base(old, None, "CK", "--base-dir") == base
    assert "an older digest (sha256-files-1) that leaves out hidden files" in capsys.readouterr().err
    wrong = {**record, "digest": "sha256-files-1:" + "0" * 64}
    assert f"{base} is not the base model CK was trained on" in _find_base(wrong)


def test_a_recorded_base_that_is_no_checkpoint_is_not_read(foreign_base, tmp_path):
    """A LoRA checkpoint's sidecar names its base by path, and a checkpoint may come from anyone: a base path that
    is a private folder was hashed whole and its file list written to the user's cache; /proc/self was an internal
    error; a FIFO in a base blocked the hash."""
    base, record, cache = foreign_base
    shutil.rmtree(cache)
    private = tmp_path / "private"
    (private / "secrets").mkdir(parents=True)
    (private / "secrets" / "key.pem").write_text("secret")
    for folder in (private, Path("/proc/self"), Path("/")):
        message = _find_base({**record, "path": str(folder)})
        assert f"CK names its base model {folder}, which is not a checkpoint" in message, message
    assert not cache.exists()
    # --base-dir given: the refusal is about the user's folder, and names the recorded base (it blamed the record)
    message = _find_base(record, given=private)
    assert message.startswith(f"--base-dir {private} is not a Megatron-Core checkpoint (") and \
        f"give the base CK was trained on, {record['path']} (digest " in message, message
    os.mkfifo(base / "release" / "queue")
    assert "queue is a FIFO, not a regular file" in _find_base(record)
    (base / "release" / "queue").unlink()
    (base / "release" / "key.pem").symlink_to(private / "secrets" / "key.pem")
    assert "which leads outside the folder" in _find_base(record)


@pytest.mark.parametrize("command", ["hf2mcore", "align"])
def test_adapter_weights_linked_outside_the_folder_are_refused(lora_models, tmp_path, capsys, command):
    """adapter_model.safetensors that links outside the peft folder was read (adapter_config.json so linked was
    refused): a file found in a folder the user names must stay inside it (docs/security.md)."""
    hf, adapter, elsewhere = lora_models["hf"]["llama3_1"], tmp_path / "a", tmp_path / "elsewhere"
    shutil.copytree(lora_models["adapters"]["llama3_1"], adapter)
    elsewhere.mkdir()
    (adapter / "adapter_model.safetensors").rename(elsewhere / "adapter_model.safetensors")
    (adapter / "adapter_model.safetensors").symlink_to(elsewhere / "adapter_model.safetensors")
    args = (["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(tmp_path / "out"), "--peft-dir", str(adapter)]
            if command == "hf2mcore" else ["align", "--hf-dir", str(hf), "--peft-dir", str(adapter)])
    rc, err = run_cli(capsys, *args)
    assert rc == 2 and "'adapter_model.safetensors', which leads outside the folder" in _one_line(err), err
    assert not (tmp_path / "out").exists()


def test_adapter_for_another_base_is_refused(lora_models, tmp_path, capsys):
    """A qwen2 adapter on a llama model: the shapes (or the modules) are not the model's."""
    other = make_tiny_hf_checkpoint("llama3_1", tmp_path / "wide", hidden_size=128, intermediate_size=192)
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(other), "--save-dir", str(tmp_path / "out"),
                      "--peft-dir", str(lora_models["adapters"]["llama3_1"]))
    assert rc == 2 and "made for another base model" in _one_line(err)
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(lora_models["hf"]["llama3_1"]), "--save-dir",
                      str(tmp_path / "out"), "--peft-dir", str(lora_models["adapters"]["deepseek_v3"]))
    assert rc == 2 and "made for another base model" in _one_line(err)


def test_deepseek_v4_adapts_its_projections_and_experts_by_peft_names():
    """The issue's sites, named as transformers loads the hub's tensors (the test adapters are made on exactly
    these, so a site dropped here would leave the parity tests passing on a smaller adapter)."""
    from megatron_patch.lora.plan import target_modules

    assert target_modules(parse_arch(families()["deepseek_v4"].tiny_config)) == {
        "qkv": ["self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_proj"], "proj": ["self_attn.o_b_proj"],
        "experts": ["mlp.experts.gate_up_proj (parameter)", "mlp.experts.down_proj (parameter)"],
        "shared_experts": ["mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"]}


def test_adapter_on_deepseek_v4_grouped_output_projection_is_refused(lora_models, tmp_path, capsys):
    """peft wraps DeepSeek-V4's grouped o_a_proj as a plain linear (its forward then fails): such an adapter is
    refused in one line that says why, before anything is written."""
    hf = lora_models["hf"]["deepseek_v4"]
    adapter = make_peft_adapter(hf, tmp_path / "o_a", modules=["q_a_proj", "o_a_proj"])
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(tmp_path / "out"),
                      "--peft-dir", str(adapter))
    assert rc == 2 and "self_attn.o_a_proj: DeepSeek-V4's grouped output projection" in _one_line(err)
    assert not (tmp_path / "out").exists()


def test_merge_lora_of_a_checkpoint_without_adapters_is_refused(lora_models, tmp_path, capsys):
    ckpt = tmp_path / "plain"
    hf_to_mcore(lora_models["hf"]["llama3_1"], ckpt, ParallelLayout(), progress=False)
    for flag in ("--merge-lora", "--lora-adapter"):
        rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "o"), flag)
        assert rc == 2 and "holds no LoRA adapters" in _one_line(err)
    rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "o"),
                      "--base-dir", str(ckpt))
    assert rc == 2 and "pass --merge-lora" in _one_line(err)


def test_launcher_lora_settings_are_checked_in_one_line(lora_models, tmp_path, capsys, monkeypatch):
    from megatron_patch.cli import main
    from tests.training_helpers import launcher_args

    prefix = tmp_path / "c_text_document"
    for suffix in (".bin", ".idx"):
        prefix.with_name(prefix.name + suffix).write_bytes(b"")
    args = launcher_args("llama3_1", DATASET_PATH=str(prefix), OUTPUT_BASEPATH=str(tmp_path / "out"))
    cases = [
        ({"MP_LORA_RANK": "4", "MP_LORA_TARGETS": "qkv,experts"}, "which a llama3_1 model does not have"),
        ({"MP_LORA_RANK": "4", "MP_LORA_TARGETS": "attention"}, "MP_LORA_TARGETS must be a comma list"),
        ({"MP_LORA_ALPHA": "8"}, "MP_LORA_ALPHA configures LoRA, which is off"),
        ({"MP_LORA_RANK": "x"}, "MP_LORA_RANK must be an integer"),
        ({"MP_LORA_RANK": "4", "MP_LORA_DROPOUT": "1"}, "MP_LORA_DROPOUT must be in [0, 1)"),
        ({"MP_LORA_INIT": str(lora_models["adapters"]["llama3_1"]), "MP_LORA_RANK": "8"},
         "MP_LORA_RANK=8 disagrees with the adapter"),
        ({"MP_LORA_INIT": str(tmp_path)}, "adapter_config.json not found"),
        # an explicit 0 asks for full fine-tuning: it trained the adapter's rank
        ({"MP_LORA_INIT": str(lora_models["adapters"]["llama3_1"]), "MP_LORA_RANK": "0"},
         "MP_LORA_RANK=0 asks for full fine-tuning, and MP_LORA_INIT="),
    ]
    for env, message in cases:
        for k in ("MP_LORA_RANK", "MP_LORA_ALPHA", "MP_LORA_TARGETS", "MP_LORA_INIT", "MP_LORA_DROPOUT"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert main(["train", "llama3_1", *args]) == 2, env
        assert message in _one_line(capsys.readouterr().err), env
    # the dry run lists the adapter's rank, alpha and targets, which train (it said MP_LORA_RANK 0: full fine-tuning)
    monkeypatch.delenv("MP_LORA_RANK")
    monkeypatch.setenv("MP_LORA_DROPOUT", "0.25")
    monkeypatch.setenv("MP_LORA_INIT", str(lora_models["adapters"]["llama3_1"]))
    monkeypatch.setenv("MP_DRY_RUN", "json")
    assert main(["train", "llama3_1", *args]) == 0
    options = json.loads(capsys.readouterr().out)["options"]
    assert {k: options[k]["value"] for k in ("MP_LORA_RANK", "MP_LORA_ALPHA", "MP_LORA_TARGETS", "MP_LORA_DROPOUT")} \
        == {"MP_LORA_RANK": "3 (MP_LORA_INIT's adapter)", "MP_LORA_ALPHA": "5 (MP_LORA_INIT's adapter)",
            "MP_LORA_TARGETS": "qkv,proj,fc1,fc2 (MP_LORA_INIT's adapter)", "MP_LORA_DROPOUT": "0.25"}
    monkeypatch.delenv("MP_DRY_RUN")
    monkeypatch.delenv("MP_LORA_DROPOUT")
    # LoRA with FP8 runs (the frozen base's GEMMs in float8: transformer-engine's or torchao's, docs/fp8.md) and, as any
    # LoRA run, needs its base checkpoint (a dry run plans without one)
    monkeypatch.delenv("MP_LORA_INIT")
    monkeypatch.setenv("MP_LORA_RANK", "4")
    fp8 = launcher_args("llama3_1", DATASET_PATH=str(prefix), OUTPUT_BASEPATH=str(tmp_path / "out"), PR="fp8")
    assert main(["train", "llama3_1", *fp8]) == 2
    assert "give its converted checkpoint as PRETRAIN_CHECKPOINT_PATH" in _one_line(capsys.readouterr().err)
    assert main(["train", "llama3_1", *args]) == 2
    assert "give its converted checkpoint as PRETRAIN_CHECKPOINT_PATH" in _one_line(capsys.readouterr().err)
    # the dry run plans a LoRA run without its weights: trainable and frozen parameters and memory per rank
    monkeypatch.setenv("MP_DRY_RUN", "1")
    assert main(["train", "llama3_1", *args]) == 0
    out = capsys.readouterr().out
    assert "(16,384 trainable, 180,800 frozen)" in out and "memory plan per rank" in out
    # and says what the launch would say of it (it said "machine check: ok" and nothing else)
    assert ("launch check: a launch would refuse this line: LoRA trains adapters on a base model: give its converted "
            "checkpoint as PRETRAIN_CHECKPOINT_PATH") in out


def test_the_default_targets_are_those_the_family_has(tmp_path, monkeypatch, capsys):
    """MP_LORA_RANK alone on an MoE family without dense MLPs was refused: 'MP_LORA_TARGETS names fc1,fc2, which a
    qwen2_moe model does not have', a variable the user never set. The default is the attention there."""
    from megatron_patch.cli import main
    from megatron_patch.training.lora_run import default_targets
    from tests.training_helpers import launcher_args

    assert default_targets(parse_arch(families()["qwen2_moe"].tiny_config)) == ("qkv", "proj")
    assert default_targets(parse_arch(families()["llama3_1"].tiny_config)) == ("qkv", "proj", "fc1", "fc2")
    prefix = tmp_path / "c_text_document"
    for suffix in (".bin", ".idx"):
        prefix.with_name(prefix.name + suffix).write_bytes(b"")
    args = launcher_args("qwen2_moe", DATASET_PATH=str(prefix), OUTPUT_BASEPATH=str(tmp_path / "out"))
    monkeypatch.setenv("MP_LORA_RANK", "4")
    monkeypatch.setenv("MP_DRY_RUN", "json")
    assert main(["train", "qwen2_moe", *args]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["resolved"]["lora"]["targets"] == ["qkv", "proj"]


def test_memory_plan_of_lora_on_llama_8b_and_70b(tmp_path):
    """On GPU layouts: the frozen base is held without gradients or optimizer state; what trains is the
    adapters, whose count per rank is the plan's (rank 16 on q, k, v, o, gate, up, down)."""
    from megatron_patch.training.memory_plan import plan_memory
    from megatron_patch.training.validation import resolve
    from tests.training_helpers import launcher_args

    prefix = tmp_path / "c_text_document"
    for suffix in (".bin", ".idx"):
        prefix.with_name(prefix.name + suffix).write_bytes(b"")
    for size, tp, pp, trainable in (("8B", 1, 1, 41_943_040), ("70B", 8, 4, None)):
        args = launcher_args("llama3_1", ENV="dsw", MODEL_SIZE=size, PR="bf16", TP=str(tp), PP=str(pp), SP=str(tp > 1),
                             DO="true", SEQ_LEN="4096", BATCH_SIZE="1", GLOBAL_BATCH_SIZE="64",
                             TRAIN_TOKENS_OR_ITERS="1e9", WARMUP_TOKENS_OR_ITERS="1e8", DATASET_PATH=str(prefix),
                             OUTPUT_BASEPATH=str(tmp_path / size))
        full = plan_memory(resolve("llama3_1", args, env={"GPUS_PER_NODE": str(tp * pp)}), "te")
        lora = plan_memory(resolve("llama3_1", args, env={"GPUS_PER_NODE": str(tp * pp), "MP_LORA_RANK": "16"}), "te")
        st, base = lora.stages[0], full.stages[0]
        if pp == 1:
            assert st.trainable == trainable  # 32 layers x 1,310,720: peft's count for rank 16
        assert st.frozen + st.trainable > 0.99 * base.trainable and st.grads < 0.02 * base.grads
        assert st.optimizer_device < 0.02 * base.optimizer_device and abs(st.params / base.params - 1) < 0.01
        assert st.device < base.device


# --- slow: logits of imported adapters against peft's, at TP, PP and EP -----------------------------------------

def _pp_layout(family: str) -> ParallelLayout:
    layers = parse_arch(families()[family].tiny_config).num_layers
    return ParallelLayout(pp=2 if layers % 2 == 0 else layers)


def _etp(family: str) -> int | None:
    """The expert-TP size the family's own parity layouts use with TP (gpt-oss's experts take biases only at
    ETP=1); None: ETP follows TP."""
    return next((layout.etp for layout in families()[family].test_layouts.parity if layout.tp > 1), None)


@pytest.fixture(scope="session")
def lora_parity(lora_models):
    """MCore's fp32 logits of every family's tiny model with its peft adapter (and the variants) at TP=1,
    TP=2, PP=2 (DeepSeek's three layers: PP=3) and, for MoE families, EP=2: one set of processes per layout."""
    hf, adapters, variants = lora_models["hf"], lora_models["adapters"], lora_models["variants"]
    tokens = random_tokens(200, batch=2, seq=24, seed=5)
    cases = {f: (hf[f], adapters[f], hf[f]) for f in FAMILY_NAMES}
    extra = {"partial": (hf["llama3_1"], variants["partial"], hf["llama3_1"]),
             "patterns": (hf["qwen2"], variants["patterns"], hf["qwen2"]),
             "saved": (hf["llama3_1"], variants["saved"], hf["llama3_1"]), "gemma4_moe": lora_models["gemma4_moe"]()}
    layouts = {"tp1": (ParallelLayout(), list(cases) + list(extra)),
               "ep2": (ParallelLayout(ep=2), MOE + ["gemma4_moe"])}
    for f in list(cases) + list(extra):
        tp2 = ParallelLayout(tp=2, etp=_etp(VARIANTS[f][0] if f in VARIANTS else f if f in families() else "gemma4"))
        layouts.setdefault(f"tp2:{tp2}", (tp2, []))[1].append(f)
    for f in FAMILY_NAMES:
        layouts.setdefault(f"pp:{_pp_layout(f)}", (_pp_layout(f), []))[1].append(f)
    every = {**cases, **extra}
    out = {}
    for name, (layout, names) in layouts.items():
        logits = mcore_lora_logits([every[n] for n in names], layout, tokens)
        out.update({(n, name.partition(":")[0]): lg for n, lg in zip(names, logits)})
    reference = {n: peft_logits(c[0], c[1], tokens) for n, c in every.items()}
    base = {n: hf_logits(c[0], tokens) for n, c in every.items()}
    return {"mcore": out, "peft": reference, "base": base}


PARITY_CASES = ([(f, layout) for f in FAMILY_NAMES for layout in ("tp1", "tp2", "pp")] + [(f, "ep2") for f in MOE]
                + [(v, layout) for v in ("partial", "patterns", "saved") for layout in ("tp1", "tp2")]
                + [("gemma4_moe", layout) for layout in ("tp1", "tp2", "ep2")])


@pytest.mark.slow
@pytest.mark.parametrize("case, layout", PARITY_CASES)
def test_imported_peft_adapter_gives_peft_logits(lora_parity, case, layout):
    ours, peft = lora_parity["mcore"][(case, layout)], lora_parity["peft"][case]
    assert rel(ours, peft) <= FP32_FLOOR, rel(ours, peft)
    assert rel(peft, lora_parity["base"][case]) > 1e-2  # the adapter changes the function: the check can fail


@pytest.mark.slow
def test_deepseek_v4_adapters_under_sequence_parallelism(lora_models):
    """DeepSeek-V4's attention gathers the sequence once and runs its projections on all of it: at TP=2 with
    sequence parallelism its adapters give peft's logits, and the factors every rank holds whole get TP=1's
    gradients (neither gathered again nor summed over TP)."""
    from megatron_patch.runtime.launch import run_local
    from tests.lora_helpers import lora_gradients_worker

    hf, adapter = str(lora_models["hf"]["deepseek_v4"]), str(lora_models["adapters"]["deepseek_v4"])
    tokens = random_tokens(200, batch=2, seq=24, seed=5)
    (one, grads_one), = run_local(lora_gradients_worker, 1, hf, adapter, ParallelLayout(), False, tokens)
    two, grads_two = run_local(lora_gradients_worker, 2, hf, adapter, ParallelLayout(tp=2), True, tokens)[0]
    assert rel(two, peft_logits(hf, adapter, tokens)) <= FP32_FLOOR
    assert grads_two.keys() <= grads_one.keys() and any(".a0" in n for n in grads_two)
    for name, grad in grads_two.items():
        assert rel(grad, grads_one[name]) <= 1e-5, name


# --- slow: training through the launcher -----------------------------------------------------------------------

ITERS = 6


def _lora_args(corpus, out, base, **over):
    from tests.training_helpers import launcher_args

    gbs, seq = 8, 64
    values = dict(DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(out), MODEL_SIZE="auto", PR="fp32", LR="5e-3",
                  MIN_LR="5e-4", GLOBAL_BATCH_SIZE=str(gbs), SEQ_LEN=str(seq), PRETRAIN_CHECKPOINT_PATH=str(base),
                  TRAIN_TOKENS_OR_ITERS=str(ITERS * gbs * seq), WARMUP_TOKENS_OR_ITERS=str(2 * gbs * seq),
                  SAVE_INTERVAL="2")
    values.update(over)
    family = values.pop("family", "llama3_1")
    return family, launcher_args(family, **values)


@pytest.fixture(scope="session")
def lora_bases(lora_models, tmp_path_factory):
    """Converted checkpoints of the tiny bases (what PRETRAIN_CHECKPOINT_PATH names), and a Qwen2-MoE base without
    the router's load-balancing loss (which peft's plain loop does not add) with its adapter."""
    root = tmp_path_factory.mktemp("bases")
    # lazy like lora_models' own (a copy of those would hold only what earlier tests happened to make)
    hf, adapters = _Lazy(lambda f: lora_models["hf"][f]), _Lazy(lambda f: lora_models["adapters"][f])
    hf["qwen2_moe_noaux"] = make_tiny_hf_checkpoint("qwen2_moe", root / "hf_moe", seed=2, router_aux_loss_coef=0.0)
    adapters["qwen2_moe_noaux"] = make_peft_adapter(hf["qwen2_moe_noaux"], root / "peft_moe")
    # Qwen3.5's dense sibling: Gated DeltaNet layers whose in_proj_qkv adapters keep B whole on each TP rank
    hf["qwen3_5_dense"] = make_tiny_hf_checkpoint("qwen3_5", root / "hf_qwen3_5", seed=2, **TINY_DENSE_CONFIG)
    adapters["qwen3_5_dense"] = make_peft_adapter(hf["qwen3_5_dense"], root / "peft_qwen3_5")
    bases = {}
    for name in ("llama3_1", "qwen2_moe_noaux", "qwen3_5_dense"):
        bases[name] = root / name
        hf_to_mcore(hf[name], bases[name], ParallelLayout(), progress=False)
    return {"hf": hf, "adapters": adapters, "bases": bases}


def _run(family, args, env=None):
    from tests.training_helpers import launch, read_metrics

    proc = launch(args, env or {}, family=family)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = Path(args[-1])
    return read_metrics(out), proc.stdout


PEFT_RUNS = {
    # name: (base, launcher arguments, extras, loss tolerance)
    "tp1_offload": ("llama3_1", dict(OPTIMIZER_OFFLOAD="0.5"), {}, 1e-6),  # the chunked optimizer, half on the host
    "tp2_pp2_vp2_sp_do_recompute": ("llama3_1", dict(TP="2", PP="2", SP="true", DO="true", AC="full"),
                                    {"MP_VP_CHUNKS": "2", "MP_TP_COMM_OVERLAP": "false"}, 1e-6),
    # peft's loop adds no load-balancing loss (transformers adds none with output_router_logits false)
    "moe_tp2_ep2": ("qwen2_moe_noaux", dict(family="qwen2_moe", TP="2", EP="2", SP="true", DO="true"),
                    {"MP_TP_COMM_OVERLAP": "false", "MP_MOE_AUX_LOSS": "0"}, 1e-6),
    "qwen3_5_tp2_sp": ("qwen3_5_dense", dict(family="qwen3_5", TP="2", ETP="2", SP="true", DO="true"),
                       {"MP_TP_COMM_OVERLAP": "false"}, 1e-6),
}


@pytest.fixture(scope="session")
def peft_runs(corpus, lora_bases, tmp_path_factory):
    """A PEFT_RUNS launcher run from an imported peft adapter, and peft's own training on the same batches
    (each made once, when a test first asks for it)."""
    from megatron_patch.training.validation import resolve

    root = tmp_path_factory.mktemp("peft_runs")
    made: dict = {}

    def get(name: str) -> dict:
        if name not in made:
            base, over, extras, tol = PEFT_RUNS[name]
            family, args = _lora_args(corpus, root / name, lora_bases["bases"][base], **over)
            env = {"MP_LORA_INIT": str(lora_bases["adapters"][base]), **extras}
            metrics, stdout = _run(family, args, env)
            cfg = resolve(family, args, env=env)
            lrs = [m["lr"] for m in metrics]  # each record's rate is the one its update applied
            losses, trained = peft_training_reference(lora_bases["hf"][base], lora_bases["adapters"][base], cfg, lrs)
            made[name] = {"metrics": metrics, "stdout": stdout, "reference": losses, "trained": trained, "tol": tol,
                          "out": root / name, "base": base, "args": (family, args, env)}
        return made[name]

    return get


@pytest.mark.slow
def test_inspect_of_a_lora_run_says_it_holds_adapters_and_what_mcore2hf_needs(peft_runs, lora_bases, capsys):
    """`mpatch inspect` of a LoRA run's final/ said "mcore2hf needs nothing: the checkpoint describes itself", and
    mcore2hf then refused it asking for --lora-adapter or --merge-lora; inspect says so now, with the base."""
    from megatron_patch.cli import main

    final = peft_runs("tp1_offload")["out"] / "final"
    capsys.readouterr()
    assert main(["inspect", str(final)]) == 0
    shown = capsys.readouterr().out
    base = lora_bases["bases"]["llama3_1"]
    assert "LoRA           adapters of rank 3, alpha 5.0, on qkv,proj,fc1,fc2" in shown, shown
    assert f"; base model {base}" in shown, shown
    assert ("mcore2hf needs --lora-adapter (the adapters as a peft folder) or --merge-lora (the model with them "
            f"merged in); --merge-lora reads the base weights from {base}") in shown, shown
    assert main(["inspect", str(final), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["lora"]["base"] == str(base) and info["mcore2hf_needs"].startswith("--lora-adapter"), info


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PEFT_RUNS))
def test_lora_training_is_peft_training(peft_runs, lora_bases, name, tmp_path):
    """A short fp32 run from an imported peft adapter trains as peft with a plain AdamW loop does on the same
    batches: equal losses at every step, and the exported adapter equals peft's trained one."""
    from safetensors.torch import load_file

    run = peft_runs(name)
    ours = [m["loss"] for m in run["metrics"]]
    assert len(ours) == ITERS and ours[-1] < ours[0]
    for i, (a, b) in enumerate(zip(ours, run["reference"])):
        assert abs(a - b) <= run["tol"] * abs(b), (i, a, b)
    print(f"{name}: losses within {max(abs(a - b) / abs(b) for a, b in zip(ours, run['reference'])):.1e} of peft's")
    out = tmp_path / "adapter"
    assert _cli("convert", "mcore2hf", "--load-dir", str(run["out"] / "final"), "--save-dir", str(out), "--lora-adapter") == 0
    exported = as_text_class(load_file(out / "adapter_model.safetensors"))
    trained = run["trained"]
    assert set(exported) == set(trained)
    start = load_file(lora_bases["adapters"][run["base"]] / "adapter_model.safetensors")
    for k in trained:
        moved = (trained[k] - start[k]).norm()
        assert moved > 0 and (exported[k] - trained[k]).norm() <= 1e-3 * moved, k


def _cli(*argv) -> int:
    from megatron_patch.cli import main

    return main(list(argv))


@pytest.mark.slow
def test_lora_kill_and_restart_equals_the_uninterrupted_run(peft_runs, corpus, lora_bases, tmp_path):
    """The TP=2 PP=2 VP=2 run, killed (SIGKILL, every rank) as iteration 4 starts and launched again, resumes its
    adapters and their optimizer state from iteration 2 and logs the uninterrupted run's losses bit for bit; its
    checkpoints hold only the adapters and their optimizer state, and name the base by path and digest."""
    from megatron_patch.checkpoint_files.torch_dist import TorchDistReader
    from tests.training_helpers import launch, read_metrics

    reference = peft_runs("tp2_pp2_vp2_sp_do_recompute")
    family, args, env = reference["args"]
    out = tmp_path / "killed"
    args = [str(out) if a == str(reference["out"]) else a for a in args]
    proc = launch(args, {**env, "MP_INJECT_FAULT": "kill@4"}, family=family)
    assert proc.returncode != 0 and "SIGKILL" in proc.stderr
    proc = launch(args, env, family=family)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "adapters from the checkpoint being resumed" in proc.stdout and "iter_0000002" in proc.stdout
    got = {m["iteration"]: m["loss"] for m in read_metrics(out)}
    want = {m["iteration"]: m["loss"] for m in reference["metrics"]}
    assert got == want
    keys = TorchDistReader(out / "checkpoint" / "iter_0000006").tensor_keys()
    assert keys and all(k.startswith("lora.") or ".lora." in k for k in keys)
    sidecar = json.loads((out / "checkpoint" / "iter_0000006" / "mpatch_checkpoint.json").read_text())
    assert sidecar["lora"]["base"]["path"] == str(lora_bases["bases"]["llama3_1"].resolve())
    # Resuming on another base is refused in one line, before any rank starts.
    other = tmp_path / "other_base"
    hf_to_mcore(lora_bases["hf"]["llama3_1"], other, ParallelLayout(tp=2), fmt="legacy", progress=False)
    moved = [str(other) if a == str(lora_bases["bases"]["llama3_1"]) else a for a in args]
    proc = launch(moved, env, family=family)
    assert proc.returncode == 2 and "is not the base model" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_lora_on_an_expert_bias_model_resumes_bit_for_bit(corpus, lora_models, tmp_path):
    """DeepSeek-V3's routers carry megatron-core's expert bias, which it moved by the experts' load after every step
    even under LoRA; LoRA checkpoints hold only the adapters, so a run stopped at iteration 2 and launched again
    went back to the base's bias and logged other losses (1e-3) than the uninterrupted run. Under LoRA the bias is
    frozen with the base, and the launch says so."""
    from tests.training_helpers import launch, read_metrics

    base = tmp_path / "base"
    hf_to_mcore(lora_models["hf"]["deepseek_v3"], base, ParallelLayout(), progress=False)
    env = {"MP_LORA_RANK": "2"}
    runs = {}
    for name, first in (("uninterrupted", {}), ("resumed", {"MP_EXIT_INTERVAL": "2"})):
        family, args = _lora_args(corpus, tmp_path / name, base, family="deepseek_v3", LR="1e-2", MIN_LR="1e-2",
                                  TRAIN_TOKENS_OR_ITERS=str(4 * 8 * 64), WARMUP_TOKENS_OR_ITERS="0")
        proc = launch(args, {**env, **first}, family=family)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "frozen, the routers' expert bias too" in proc.stdout
        if first:
            proc = launch(args, env, family=family)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            assert "adapters from the checkpoint being resumed" in proc.stdout
        runs[name] = {m["iteration"]: m["loss"] for m in read_metrics(tmp_path / name)}
    assert len(runs["uninterrupted"]) == 4 and runs["resumed"] == runs["uninterrupted"]


SFT_RECORDS = [
    {"prompt": "Where does the cat sit?", "response": "The cat sits on the warm mat."},
    {"instruction": "Describe the river.", "output": "A quiet river by the sea."},
    {"prompt": "Name a fruit.", "response": "A green apple."},
]


@pytest.mark.slow
def test_lora_sft_run_exports_an_adapter_peft_loads(corpus, lora_bases, tmp_path, capsys):
    """A packed bf16 LoRA SFT run at TP=2 with SP and the distributed optimizer: the loss falls; it trains exactly
    peft's parameter count for the same targets and rank; the base checkpoint is untouched and the run's
    checkpoints hold only adapters; the exported adapter loads in peft and gives the MCore model's logits; the
    merged export gives peft's merge_and_unload logits, and keeps every unadapted weight bit for bit."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    from megatron_patch.checkpoint_files.torch_dist import TorchDistReader
    from megatron_patch.lora.state import checkpoint_digest
    from tests.training_helpers import write_jsonl

    base, hf = lora_bases["bases"]["llama3_1"], lora_bases["hf"]["llama3_1"]
    digest = checkpoint_digest(base)
    write_jsonl(tmp_path / "sft.jsonl", SFT_RECORDS * 12)
    out = tmp_path / "out"
    family, args = _lora_args(corpus, out, base, SFT="true", DATASET_PATH=str(tmp_path / "sft.jsonl"), PAD_LEN="48",
                              SEQ_LEN="64", TRAIN_TOKENS_OR_ITERS="10", WARMUP_TOKENS_OR_ITERS="1", LR="2e-2",
                              MIN_LR="2e-3", GLOBAL_BATCH_SIZE="4", TP="2", SP="true", DO="true", PR="bf16",
                              SAVE_INTERVAL="5")
    metrics, stdout = _run(family, args, {"MP_LORA_RANK": "8", "MP_LORA_ALPHA": "16", "MP_TOKENIZER": str(corpus["tok"]),
                                          "MP_SFT_PACKING": "true", "MP_TP_COMM_OVERLAP": "false"})
    losses = [m["loss"] for m in metrics]
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.1, losses
    final = out / "final" / "release"
    stored = TorchDistReader(final)
    peft = get_peft_model(load_hf(hf), LoraConfig(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    assert sum(math_prod(stored.global_shape(k)) for k in stored.tensor_keys()) == peft.get_nb_trainable_parameters()[0]
    assert checkpoint_digest(base) == digest
    assert all(k.startswith("lora.") or ".lora." in k for k in TorchDistReader(out / "checkpoint" / "iter_0000010").tensor_keys())

    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert _cli("convert", "mcore2hf", "--load-dir", str(out / "final"), "--save-dir", str(adapter), "--lora-adapter") == 0
    # the HF folder the run's base was converted from, which peft's AutoPeftModel loads
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(hf.resolve())
    assert _cli("convert", "mcore2hf", "--load-dir", str(out / "final"), "--save-dir", str(merged), "--merge-lora",
                "--quiet") == 0
    tokens = random_tokens(200, batch=2, seq=24, seed=7)
    (ours,) = mcore_lora_logits([(base, out / "final", hf)], ParallelLayout(tp=2), tokens)
    theirs = peft_logits(hf, adapter, tokens)
    assert rel(ours, theirs) <= FP32_FLOOR and rel(theirs, hf_logits(hf, tokens)) > 1e-3
    assert rel(hf_logits(merged, tokens), peft_logits(hf, adapter, tokens, merged=True)) <= 1e-6
    before, after = load_file(hf / "model.safetensors"), load_file(merged / "model.safetensors")
    adapted = {f"model.layers.{i}.{m}.weight" for i in range(4) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
        "mlp.down_proj")}
    assert set(before) == set(after)
    for name in before:
        assert torch.equal(before[name], after[name]) != (name in adapted), name
    # The newest iteration damaged (its train_state.json edited): the exports of the run's checkpoint folder take the
    # previous one with a warning, as plain mcore2hf does; --no-verify reads the newest as it is, in export and eval
    # alike (the adapters were read from another iteration than the model's description)
    checkpoints, newest = out / "checkpoint", out / "checkpoint" / "iter_0000010"
    (newest / "train_state.json").write_text((newest / "train_state.json").read_text().replace('"iteration": 10',
                                                                                               '"iteration": 11'))
    capsys.readouterr()

    def exported(name, *argv) -> dict:
        assert _cli("convert", "mcore2hf", "--save-dir", str(tmp_path / name), "--lora-adapter", *argv) == 0
        return load_file(tmp_path / name / "adapter_model.safetensors")

    skipped = exported("a_root", "--load-dir", str(checkpoints))
    assert f"warning: {newest} is incomplete or damaged" in capsys.readouterr().err
    assert _same_tensors(skipped, exported("a_5", "--load-dir", str(checkpoints / "iter_0000005")))
    assert _same_tensors(exported("a_root_nv", "--load-dir", str(checkpoints), "--no-verify"),
                         exported("a_10", "--load-dir", str(newest), "--no-verify"))

    def perplexity(load_dir, name, *extra) -> float:
        assert _cli("eval", "--load-dir", str(load_dir), "--tasks", "mpatch_perplexity", "--limit", "2", "--quiet",
                    "--no-verify", "--output-dir", str(tmp_path / name), *extra) == 0
        return json.loads((tmp_path / name / "results.json").read_text())["results"]["mpatch_perplexity"]
    assert perplexity(checkpoints, "e_root") == perplexity(newest, "e_10") != perplexity(
        checkpoints / "iter_0000005", "e_5")
    in_place = perplexity(out / "final", "e_final")
    # The base moved: the export says in one line what to give, and takes it (checked by digest) from --base-dir.
    moved = tmp_path / "moved_base"
    shutil.copytree(base, moved)
    shutil.rmtree(base)
    try:
        capsys.readouterr()
        assert _cli("convert", "mcore2hf", "--load-dir", str(out / "final"), "--save-dir", str(tmp_path / "m2"),
                    "--merge-lora") == 2
        assert "give that checkpoint with --base-dir" in _one_line(capsys.readouterr().err)
        assert _cli("convert", "mcore2hf", "--load-dir", str(out / "final"), "--save-dir", str(tmp_path / "m2"),
                    "--merge-lora", "--base-dir", str(moved), "--quiet") == 0
        # mpatch eval the same (it said "give that checkpoint with its base", naming no option: the ldoc audit)
        assert _cli("eval", "--load-dir", str(out / "final"), "--tasks", "mpatch_perplexity", "--limit", "2",
                    "--quiet", "--no-verify") == 2
        assert "give that checkpoint with --base-dir" in _one_line(capsys.readouterr().err)
        assert perplexity(out / "final", "e_moved", "--base-dir", str(moved)) == in_place
        # mpatch align too (it took no other base and said where to put it back): refused before any rank starts,
        # then taken from --base-dir, checked by digest, by the main process and by the ranks that load the run
        align = ["align", "--hf-dir", str(hf), "--peft-dir", str(adapter), "--mcore-dir", str(out / "final"),
                 "--dtype", "fp32", "--seq-len", "8", "--batch", "1", "--quiet", "--no-verify"]
        assert _cli(*align) == 2 and "give that checkpoint with --base-dir" in _one_line(capsys.readouterr().err)
        assert _cli(*align, "--base-dir", str(base)) == 2  # the old place, gone
        assert f"({base} is not a folder): give that checkpoint with --base-dir" in _one_line(capsys.readouterr().err)
        from megatron_patch.align.alignment import AlignSettings, validate
        from megatron_patch.align.runner import McoreRun, _adapters_of
        settings = AlignSettings(hf_dir=str(hf), mcore_dir=str(out / "final"), peft_dir=str(adapter), dtype="fp32",
                                 verify=False, base_dir=str(moved))
        _, test_arch, _ = validate(settings)
        run = McoreRun("fp32", hf_dir=str(hf), mcore_dir=str(out / "final"), peft_dir=str(adapter), verify=False,
                       base_dir=str(moved))
        assert _adapters_of(run, test_arch).base == moved
    finally:
        shutil.copytree(moved, base)


@pytest.mark.slow
def test_a_lora_run_with_modules_to_save_is_evaluated_in_place(corpus, lora_models, lora_bases, tmp_path):
    """A LoRA run started from a peft adapter with modules_to_save (lm_head, the final norm) keeps those weights
    beside its adapters, not in its base: `mpatch eval` of its final/ was refused, "start from its peft export"
    (the ldoc audit; docs/evaluation.md takes a LoRA run). It evaluates, with the run's trained weights laid over
    the base: those its peft export holds."""
    from megatron_patch.convert.lora_io import export_adapter
    from megatron_patch.lora.sources import open_adapters

    out = tmp_path / "run"
    family, args = _lora_args(corpus, out, lora_bases["bases"]["llama3_1"], TRAIN_TOKENS_OR_ITERS=str(2 * 8 * 64),
                              WARMUP_TOKENS_OR_ITERS="0")
    _run(family, args, {"MP_LORA_INIT": str(lora_models["variants"]["saved"])})
    arch = parse_arch(lora_models["hf"]["llama3_1"])
    laid = open_adapters(out / "final", arch).saved
    exported = read_peft_adapter(export_adapter(out / "final", tmp_path / "peft"), arch)[2]
    assert laid.keys() == exported.keys() == {"lm_head.weight", "model.norm.weight"}, (laid.keys(), exported.keys())
    assert all(torch.equal(laid[k], exported[k]) for k in laid)
    trained = read_peft_adapter(lora_models["variants"]["saved"], arch)[2]
    assert not torch.equal(laid["lm_head.weight"], trained["lm_head.weight"])  # the run's, not the start's
    assert _cli("eval", "--load-dir", str(out / "final"), "--tasks", "mpatch_perplexity", "--limit", "2", "--quiet",
                "--tokenizer", str(corpus["tok"])) == 0


def _same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def math_prod(shape) -> int:
    import math

    return math.prod(shape)


# --- slow: the memory plan against what LoRA runs allocate ------------------------------------------------------

LORA_MEMORY = [  # (processes, base, launcher arguments, extras)
    (1, "llama3_1", dict(PR="bf16", DO="true"), {"MP_LORA_RANK": "8"}),
    (1, "llama3_1", dict(PR="bf16", AC="sel"), {"MP_LORA_RANK": "8", "MP_LORA_TARGETS": "qkv,fc2"}),
    (1, "llama3_1", dict(PR="bf16", OPTIMIZER_OFFLOAD="0.5"), {"MP_LORA_RANK": "8"}),
    (1, "qwen2_moe_noaux", dict(family="qwen2_moe", PR="bf16", DO="true"),
     {"MP_LORA_RANK": "4", "MP_LORA_TARGETS": "qkv,proj,experts,shared_experts"}),
    (2, "llama3_1", dict(PR="bf16", TP="2", SP="true", DO="true"), {"MP_LORA_RANK": "8", "MP_TP_COMM_OVERLAP": "false"}),
    (2, "llama3_1", dict(PR="fp32", PP="2", AC="full"), {"MP_LORA_RANK": "8"}),
    (2, "qwen2_moe_noaux", dict(family="qwen2_moe", PR="bf16", EP="2", DO="true"),
     {"MP_LORA_RANK": "4", "MP_LORA_TARGETS": "qkv,experts"}),
    # Qwen3.5's in_proj_qkv adapters keep B whole on each TP rank
    (2, "qwen3_5_dense", dict(family="qwen3_5", PR="fp32", TP="2", ETP="2", DO="true"), {"MP_LORA_RANK": "4"}),
]


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_memory_plan_equals_what_lora_runs_allocate(corpus, lora_bases, tmp_path, processes):
    """Model state to the byte (frozen base outside DDP's buffers; adapters' gradients and optimizer state, Qwen3.5's
    whole-B adapters included) and activations within 10% for the dense models of standard attention layers (a
    frozen base keeps fewer tensors; the adapters add theirs)."""
    from megatron_patch.runtime.launch import run_local
    from megatron_patch.training.memory_plan import _place_chunks, plan_memory, stage_memory
    from megatron_patch.training.validation import resolve
    from tests.memory_helpers import measure_ranks

    cases = [c for c in LORA_MEMORY if c[0] == processes]
    cfgs = []
    for i, (_, base, over, env) in enumerate(cases):
        family, args = _lora_args(corpus, tmp_path / str(i), lora_bases["bases"][base], SAVE_INTERVAL="100",
                                  **{"PR": "bf16", **over})
        cfgs.append(resolve(family, args, env=env))
    per_rank = run_local(measure_ranks, processes, cfgs, timeout=900)
    for i, cfg in enumerate(cfgs):
        for r in (rank[i] for rank in per_rank):
            st = stage_memory(cfg.arch, cfg, r["pp_rank"], "local", r["dp_rank"])
            plan = plan_memory(cfg, "local")
            if plan.offload_policy != "off":
                _place_chunks(st, plan.offload_share, cfg.precision.itemsize)
            planned = {k: getattr(st, k) for k in ("params", "grads", "optimizer_device", "optimizer_host")}
            assert planned == {k: r[k] for k in planned}, (cfg.family, str(cfg.layout))
            assert st.frozen > st.trainable > 0
            # activations: modelled for standard attention layers (Qwen3.5's Gated DeltaNet: 27% under here, not LoRA's)
            if not cfg.arch.is_moe and not cfg.arch.layer_types:
                assert abs(st.activations / r["activations"] - 1) < 0.10, (str(cfg.layout), st.activations, r)


def test_a_moved_base_is_asked_for_by_the_option_that_names_it_or_where_to_put_it(tmp_path):
    """Readers of a LoRA run whose base moved said "give that checkpoint with its base", naming no option (the ldoc
    audit): mcore2hf and eval name --base-dir; align and a training start, which take no other base, the place."""
    from megatron_patch.errors import UserError
    from megatron_patch.lora.state import find_base

    record = {"path": str(tmp_path / "gone"), "digest": "sha256-files-3:0123456789abcdef"}
    with pytest.raises(UserError, match=r"which is not there: give that checkpoint with --base-dir$"):
        find_base(record, None, "the run", "--base-dir")
    with pytest.raises(UserError, match=rf"which is not there: put that checkpoint back at {tmp_path / 'gone'}$"):
        find_base(record, None, "the run", None)


@pytest.fixture(scope="module")
def imported_lora(tmp_path_factory):
    """A LoRA checkpoint of the tiny Llama from a rank-3 peft adapter (hf2mcore --peft-dir)."""
    from tests.lora_helpers import make_peft_adapter

    root = tmp_path_factory.mktemp("imported")
    hf = make_tiny_hf_checkpoint("llama3_1", root / "hf", seed=1)
    make_peft_adapter(hf, root / "peft", modules=["q_proj", "v_proj"], r=3, lora_alpha=6)
    from megatron_patch.cli import main

    assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(root / "ckpt"), "--peft-dir",
                 str(root / "peft"), "--quiet"]) == 0
    return root / "ckpt"


@pytest.mark.parametrize("edit, said", [
    ({"rank": 6}, "is [3, 64], and the checkpoint's record of its LoRA settings (rank, targets) makes it [6, 64]"),
    ({"rank_pattern": {"(": 3}}, "its spec's 'rank_pattern' is of the wrong type or value"),
], ids=["rank", "pattern-no-regex"])
def test_a_lora_record_that_lies_about_its_tensors_is_refused_by_both_exports(imported_lora, tmp_path, capsys, edit,
                                                                              said):
    """The lora audit: a sidecar saying rank 6 over rank-3 tensors merged at alpha/6 (half the change the adapters
    compute) and exported r: 6 beside them, exit 0; a pattern that is no regular expression was an internal error.
    Each is one line, exit 2, in --merge-lora and --lora-adapter."""
    from megatron_patch.checkpoint_files.manifest import write_manifest

    ckpt = tmp_path / "ckpt"
    shutil.copytree(imported_lora, ckpt)
    sidecar = ckpt / "mpatch_checkpoint.json"
    data = json.loads(sidecar.read_text())
    data["lora"]["spec"].update(edit)
    sidecar.write_text(json.dumps(data))
    write_manifest(ckpt, "edited")  # a manifest that agrees, as anyone can write one
    for how in ("--merge-lora", "--lora-adapter"):
        rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / how),
                          how, "--quiet")
        assert rc == 2 and said in err and err.count("\n") == 1, err
        assert not (tmp_path / how).exists()


def test_modules_to_save_a_checkpoint_never_saved_are_one_line(tmp_path):
    """A LoRA run's record naming modules_to_save (lm_head) whose weights its checkpoint does not hold was a KeyError
    in both exports (the lora audit)."""
    import torch.distributed.checkpoint as dcp

    from megatron_patch.errors import UserError
    from megatron_patch.lora.saved import stored_saved_tensors

    dcp.save({"embedding.word_embeddings.weight": torch.zeros(4, 4)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    arch = parse_arch(families()["llama3_1"].tiny_config)
    spec = LoraSpec(rank=2, alpha=4.0, targets=("qkv",), modules_to_save=("lm_head",))
    with pytest.raises(UserError, match="holds no output_layer.weight, which its record's modules_to_save names"):
        stored_saved_tensors(tmp_path / "ck", arch, spec)


@pytest.mark.parametrize("edit, said", [
    (lambda c: c.pop("target_parameters"), "which its adapter_config.json's target_parameters"),
    (lambda c: c.update(target_parameters=["mlp.experts.down_proj"]), "gate_up_proj, which its adapter_config.json's"),
    (lambda c: c.update(rank_pattern={"mlp.experts.gate_up_proj": 6, "mlp.experts.down_proj": 6}),
     "gives it rank 6 (r, rank_pattern): peft refuses it"),
], ids=["no-target-parameters", "down-only", "expert-rank"])
def test_routed_expert_adapters_are_held_to_their_config(lora_models, tmp_path, capsys, edit, said):
    """Stacked routed-expert adapters were taken as the file had them, whatever adapter_config.json said: a config
    without target_parameters (peft builds no expert adapters) gave MCore logits 0.15 off peft's, and another rank
    in rank_pattern (peft refuses the folder) was accepted (the lora audit). Refused as for plain modules."""
    adapter = tmp_path / "peft"
    shutil.copytree(lora_models["adapters"]["qwen2_moe"], adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    edit(config)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    hf = lora_models["hf"]["qwen2_moe"]
    capsys.readouterr()  # what making the models printed
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir",
                      str(tmp_path / "out"), "--peft-dir", str(adapter), "--quiet")
    assert rc == 2 and said in err and err.count("\n") == 1, err


def test_the_dry_run_refuses_a_lora_export_whose_base_moved(imported_lora, corpus, tmp_path, capsys, monkeypatch):
    """A LoRA checkpoint given as PRETRAIN_CHECKPOINT_PATH to continue from names its base; moved, the dry run planned
    the run ("would start afresh", exit 0) and the ranks refused it (the lora audit). The dry run refuses it as the
    launch does, saying where to put the base back (no launcher option names another)."""
    from megatron_patch.checkpoint_files.manifest import write_manifest
    from tests.training_helpers import launcher_args

    ckpt = tmp_path / "ckpt"
    shutil.copytree(imported_lora, ckpt)
    sidecar = ckpt / "mpatch_checkpoint.json"
    data = json.loads(sidecar.read_text())
    data["lora"]["base"] = {"path": str(tmp_path / "gone"), "digest": "sha256-files-3:0123456789abcdef"}
    sidecar.write_text(json.dumps(data))
    write_manifest(ckpt, "edited")
    args = launcher_args("llama3_1", MODEL_SIZE="auto", PRETRAIN_CHECKPOINT_PATH=str(ckpt),
                         DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(tmp_path / "run"))
    for name, value in {"MP_DRY_RUN": "1", "MP_LORA_RANK": "3", "MP_LORA_ALPHA": "6", "MP_LORA_TARGETS": "qkv"}.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    rc, err = run_cli(capsys, "train", "llama3_1", *args)
    assert rc == 2 and err.count("\n") == 1, err
    assert f"which is not there: put that checkpoint back at {tmp_path / 'gone'}" in err, err


def test_the_same_targets_in_another_order_are_the_same_adapters(lora_models, lora_bases, corpus, tmp_path):
    """MP_LORA_TARGETS=proj,qkv,fc1,fc2 beside an MP_LORA_INIT adapter of qkv,proj,fc1,fc2, and a resume relaunched
    with the targets reordered, were refused as other adapters (the lora audit)."""
    from megatron_patch.training.run_state import _lora_change
    from megatron_patch.training.validation import resolve
    from tests.training_helpers import launcher_args

    args = launcher_args("llama3_1", MODEL_SIZE="auto", DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(tmp_path),
                         PRETRAIN_CHECKPOINT_PATH=str(lora_bases["bases"]["llama3_1"]))
    adapter = str(lora_models["adapters"]["llama3_1"])
    cfg = resolve("llama3_1", args, env={"MP_LORA_INIT": adapter})
    reordered = ",".join(reversed(cfg.lora["targets"]))
    assert resolve("llama3_1", args, env={"MP_LORA_INIT": adapter, "MP_LORA_TARGETS": reordered}).lora == cfg.lora
    then = {"lora": {**cfg.lora, "targets": list(reversed(cfg.lora["targets"]))}}
    assert _lora_change(then, {"lora": cfg.lora}) is None
    assert _lora_change({"lora": {**then["lora"], "rank": cfg.lora["rank"] + 1}}, {"lora": cfg.lora}) is not None
