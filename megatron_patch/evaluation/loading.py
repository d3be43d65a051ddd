"""The model an evaluation reads from a checkpoint: what it is (before any rank starts) and the loaded model
(on each rank), through the same loaders as training and the aligner.

A checkpoint is anything ``convert.arch_source.open_checkpoint`` reads: a conversion, a run's iteration or its
``final``, another tool's checkpoint with ``--hf-config``; a LoRA checkpoint is loaded as its base with the
adapters applied (``lora.sources``), as the aligner does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import jinja2

from megatron_patch.checkpoint.arch_source import open_checkpoint
from megatron_patch.dtypes import precision_dtype
from megatron_patch.errors import UserError
from megatron_patch.input_files import read_json_object
from megatron_patch.models.description.arch import Arch, default_expert_tp, validate_layout
from megatron_patch.runtime.distributed import ParallelLayout
from megatron_patch.tokenizer import load_hf_tokenizer, load_tokenizer

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: `mpatch eval` checks its input (tasks, tokenizer, layout) before any rank starts.

# A tokenizer folder holds one of these (what transformers' AutoTokenizer reads without remote code).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass(frozen=True)
class CheckpointToEvaluate:
    """A checkpoint, its model and the tokenizer folder that goes with it, checked before any rank starts."""

    load_dir: str
    arch: Arch
    tokenizer_dir: str
    hf_config: str | None = None
    verify: bool = True
    model_config: dict | None = None  # the model's HF config.json, as the checkpoint records it
    notes: tuple[str, ...] = ()  # what reading it found worth a warning (an --hf-config it ignores)
    model_dir: str | None = None  # the folder of the files the checkpoint carries (generation_config.json)
    layout: ParallelLayout | None = None  # the layout asked, with hf2mcore's default ETP where none was given
    layout_note: str | None = None  # the line that says that default, where it is not TP
    base_dir: str | None = None  # a LoRA run's base, where it is no longer where the run recorded it (--base-dir)

    def load_tokenizer(self):
        """transformers' tokenizer of ``tokenizer_dir``, built as preprocessing and training build that folder's."""
        return load_hf_tokenizer(self.tokenizer_dir)


def open_for_evaluation(load_dir: str | Path, layout: ParallelLayout, tokenizer: str | Path | None = None,
                        hf_config: str | Path | None = None, verify: bool = True,
                        chat_template: bool = False, base_dir: str | Path | None = None) -> CheckpointToEvaluate:
    """The checkpoint at ``load_dir``, refused in one line when the layout does not divide its model, or no
    tokenizer is found (``tokenizer`` wins over the files the checkpoint carries), or the tokenizer does not fit
    the model (``check_tokenizer``; ``chat_template``: prompts are rendered with its chat template)."""
    opened = open_checkpoint(load_dir, hf_config=hf_config, family_option=None, verify=verify)
    arch = opened.model_arch
    if base_dir is not None and not (opened.sidecar.lora or {}).get("base"):
        raise UserError(f"--base-dir names the base of a LoRA run's checkpoint, and {load_dir} is none")
    # the expert-tensor-parallel size hf2mcore and align take where none is given (gpt_oss's biased experts: ETP=1)
    layout, layout_note = default_expert_tp(arch, layout)
    validate_layout(arch, layout, uneven_pipelines=False)
    if tokenizer is not None:
        tokenizer_dir = _tokenizer_folder(Path(tokenizer), "--tokenizer")
    else:
        candidates = [opened.sidecar_dir, opened.found.folder]
        if hf_config is not None:
            candidates.append(Path(hf_config) if Path(hf_config).is_dir() else Path(hf_config).parent)
        found = next((c for c in candidates if _has_tokenizer(c)), None)
        if found is None:
            raise UserError(f"{load_dir} carries no tokenizer (tokenizer.json, tokenizer.model or vocab.json): give "
                            "--tokenizer DIR, the HF folder of the model")
        tokenizer_dir = found
    check_tokenizer(load_hf_tokenizer(tokenizer_dir), arch.vocab_size, chat_template)
    return CheckpointToEvaluate(str(load_dir), arch, str(tokenizer_dir),
                                None if hf_config is None else str(hf_config), verify, opened.sidecar.hf_config,
                                tuple(opened.found.notes + opened.notes), str(opened.sidecar_dir), layout, layout_note,
                                None if base_dir is None else str(base_dir))


def generation_stop_ids(model_config: dict | None, folder: str | Path | None) -> frozenset[int]:
    """The ids transformers' generate stops at for lm-eval's HF backend, whatever tokenizer folder is given: the
    eos_token_id of the model's generation_config.json (``folder``'s), else of its config.json."""
    generation = Path(folder) / "generation_config.json" if folder is not None else None
    if generation is not None and generation.is_file():
        named = read_json_object(generation, inside=Path(folder)).get("eos_token_id")
    else:
        config = model_config or {}
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        named = config.get("eos_token_id", text.get("eos_token_id"))
    named = named if isinstance(named, list) else [named]
    return frozenset(i for i in named if isinstance(i, int) and not isinstance(i, bool))


def check_tokenizer(tokenizer, vocab_size: int, chat_template: bool = False, give: str = "--tokenizer DIR") -> None:
    """Refuse, in one line, a tokenizer (transformers') the harness cannot use with a model of ``vocab_size`` ids:
    one with ids the model has no row for (megatron's padding rows would score them: perplexity inf; or an index
    error past them), one without an end-of-text token (``end_of_text_id``), or, with ``chat_template``, one without
    a chat template."""
    ids = max(tokenizer.get_vocab().values(), default=-1) + 1
    if ids > vocab_size:
        raise UserError(f"the tokenizer in {tokenizer.name_or_path} yields ids beyond the model's vocabulary "
                        f"({vocab_size}): it has {ids} ids; give the model's own tokenizer ({give})")
    end_of_text_id(tokenizer)
    if chat_template and not tokenizer.chat_template:
        raise UserError(f"--apply-chat-template: the tokenizer in {tokenizer.name_or_path} has no chat template "
                        "(chat_template in tokenizer_config.json, or chat_template.jinja)")
    if chat_template:  # rendered once here, before the ranks load the model, as the harness renders each prompt
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "1 plus 1?"}], tokenize=False,
                                          add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - whatever the template's expressions raise in jinja's sandbox
            raise UserError(f"--apply-chat-template: the chat template of the tokenizer in {tokenizer.name_or_path} "
                            f"fails on a one-question chat ({template_failure(exc)}): fix the template, or evaluate "
                            "without --apply-chat-template") from None


def template_failure(exc: Exception) -> str:
    """A chat template's failure in a few words: a TemplateError's (raise_exception's) message is the template's
    own, any other exception its expressions raised is named by its type."""
    text = " ".join(str(exc).split())[:200]
    return text if isinstance(exc, jinja2.exceptions.TemplateError) else f"{type(exc).__name__}: {text}"


def end_of_text_id(tokenizer) -> int:
    """The id that ends a text for the harness (its ``eot_token_id``, and the prefix of a text without context where
    the tokenizer has no bos): the tokenizer's eos; where it names none (a folder with tokenizer.json alone), the
    end-of-document token this project's tokenizer finds there, the one preprocessing ends each document with."""
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    folder = Path(tokenizer.name_or_path)
    if (folder / "tokenizer.json").is_file():
        with contextlib.suppress(UserError):  # no end-of-document token found there either: refused below
            return load_tokenizer(folder).eod
    raise UserError(f"the tokenizer in {folder} names no end-of-text token: add eos_token to its "
                    "tokenizer_config.json")


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES[:3])


def _tokenizer_folder(path: Path, flag: str) -> Path:
    folder = path if path.is_dir() else path.parent
    if not _has_tokenizer(folder):
        raise UserError(f"{flag} {path} is not an HF tokenizer folder (no tokenizer.json, tokenizer.model or "
                        "vocab.json in it)")
    return folder


def load_model(checkpoint: CheckpointToEvaluate, layout: ParallelLayout, dtype: str = "fp32") -> list:
    """This rank's model chunks at ``layout``, filled from the checkpoint (its adapters applied), on this rank's
    device. Call after ``runtime.init_model_parallel(layout)``."""
    # torch and megatron-core: imported only on the ranks that build the model
    from megatron_patch.checkpoint.loading import load_checkpoint_into_model
    from megatron_patch.lora.sources import add_adapters, open_adapters
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.blocks.inference import place_on_rank_device

    arch, torch_dtype = checkpoint.arch, precision_dtype(dtype)
    model = build_model(arch, layout, torch_dtype)
    opened = open_checkpoint(checkpoint.load_dir, hf_config=checkpoint.hf_config, verify=checkpoint.verify)
    adapters = (open_adapters(checkpoint.load_dir, arch, checkpoint.verify, checkpoint.base_dir, "--base-dir")
                if opened.sidecar.lora else None)
    base = adapters.base if adapters is not None and adapters.base is not None else checkpoint.load_dir
    load_checkpoint_into_model(model, base, layout, hf_config=checkpoint.hf_config, verify=checkpoint.verify)
    if adapters is not None:
        add_adapters([model], arch, adapters, layout, torch_dtype)
    return [place_on_rank_device(model)]


def padding_is_neutral(arch: Arch) -> bool:
    """Whether padding after a sequence leaves its log-likelihoods alone: not under DeepSeek sparse attention here,
    whose indexer's choice changes with the padded length (measured: 2e-2 relative on a tiny model), nor where the
    family says so (``FamilyConfig.padding_is_neutral``: DeepSeek-V4's compressed attention). Generation pads
    nothing (a batch's prompts are of one length), with a cache or without."""
    return arch.sparse_attention is None and (arch.family_config is None or arch.family_config.padding_is_neutral)

