"""The model family: the one extension point for a new architecture.

A family (one folder under ``models/``) owns everything family-specific and registers itself from
its own ``__init__.py`` (``registry.register``):

- which Hugging Face checkpoints it claims (``model_type`` / ``architectures``) and how their
  config.json becomes an ``Arch``, plus the TransformerConfig fields it adds;
- its weight table (``mapping.py``, written in the vocabulary of ``models.mapping``), the HF names it
  ignores (buffers such as rotary ``inv_freq``) and, through the table, the names it ties;
- presets of the published sizes (the launcher's MODEL_SIZE) and a tiny config for tests and demos;
- its megatron-core layer spec where megatron-core's standard one does not fit, and the model-level pieces around
  it (``finish_model``: a post-build hook on the GPTModel) with its own typed settings (``Arch.family_config``);
- its launcher's parallel arguments (where EP / ETP sit in the positional list), Pai-Megatron-Patch's names
  for its sizes and the Pai launchers that train it, and the weight decay Pai's script for it passes;
- the HF module paths the aligner captures;
- the layouts its tests run;
- multi-token-prediction layers and the HF tensors that are copies of others, if it has any.

Everything else (converter, aligner, trainer, CLI choices, launcher argument lists, docs tables,
parametrized tests) reads the registered families and never names one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

from megatron_patch.models.description.arch import Arch
from megatron_patch.models.mapping import Rule, tied_hf_names
from megatron_patch.runtime.distributed import ParallelLayout


@dataclass(frozen=True)
class HFModules:
    """Attribute paths into the transformers model, for the aligner's capture points. A tuple gives
    alternatives, the first the model has is used (transformers 4.x and 5.x name some blocks apart)."""

    embedding: str | tuple[str, ...] = "model.embed_tokens"  # a multimodal class: model.language_model.embed_tokens
    layers: str | tuple[str, ...] = "model.layers"
    attention: str | tuple[str, ...] = "self_attn"  # within a decoder layer (Qwen3-Next: or linear_attn)
    mlp: str | tuple[str, ...] = "mlp"  # within a decoder layer
    final_norm: str | tuple[str, ...] = "model.norm"
    # Within an MoE layer: the router (its output holds the chosen experts, or only logits in 4.x).
    router: str | tuple[str, ...] | None = None
    # Within the router: the module whose output is its logits, where the router returns probabilities first
    # (Gemma 4's ``router.proj``); None: the router's own first output.
    router_logits: str | None = None
    # Within a decoder layer: a sparse attention's indexer (its output holds each query's top-k keys, or blocks of
    # keys: DeepSeek-V4's CSA indexer); layers without one (V4's sliding and HCA layers) are skipped.
    indexer: str | tuple[str, ...] | None = None
    # Within a decoder layer, on both sides (the family names its MCore layer's module alike): a module whose input is
    # the residual after the attention's step, captured as ``layers.{i}.residual`` (DeepSeek-V4's ffn_hc: the
    # streams after the attention's hyper-connection); None: no such point, the layer's output speaks for it.
    attention_residual: str | None = None


@dataclass(frozen=True)
class TestLayouts:
    """What a family's tests run: logit parity in local gloo processes (costly: keep it short) and
    bit-exact conversion round trips in process, as (format, layout, dtype)."""

    parity: tuple[ParallelLayout, ...] = (ParallelLayout(), ParallelLayout(tp=2), ParallelLayout(pp=2))
    # The memory plan against what a one-process run allocates (tests/test_memory_plan.py): launcher arguments,
    # environment, and whether its activations are held to the plan (dense models) or only printed (MoE: routing).
    memory_plan: tuple[tuple[dict, dict, bool], ...] = ((dict(PR="bf16", DO="true"), {}, False),)
    round_trips: tuple[tuple[str, ParallelLayout, str], ...] = (
        ("legacy", ParallelLayout(tp=2, pp=2), "bf16"), ("torch_dist", ParallelLayout(tp=2), "fp32"))


def _no_extra_config(arch: Arch) -> dict:
    return {}


def _no_mtp_layers(raw: dict) -> int:
    return 0


def _no_recompute_limits(arch: Arch, mode: str, megatron_core: tuple[int, ...]) -> str | None:
    return None


def _no_copies(arch: Arch) -> dict[str, str]:
    return {}


def _layers_after_decoder(arch: Arch, count: int) -> tuple[str, ...]:
    return tuple(f"model.layers.{arch.num_layers + k}." for k in range(count))


def _no_stacks(arch: Arch) -> dict[str, tuple[str, ...]]:
    return {}


@dataclass(frozen=True)
class PaiLauncher:
    """A launcher script of Pai-Megatron-Patch's that trains this family, run here by a thin alias at the same
    path under examples/: the parallel sizes it takes after CP, and the MODEL_SIZE names it takes for this family
    (name -> preset; None: every preset and size alias of the family)."""

    script: str
    parallel_args: tuple[str, ...]
    sizes: Mapping[str, str] | None = None
    # the AdamW weight decay that script passes for this family, where it is not the family's (``weight_decay``)
    weight_decay: float | None = None
    # its --moe-aux-loss-coeff for this family, where not the 0.001 most of Pai's MoE scripts pass (Megatron-LM's
    # default 0.0 where the script passes none), and its --moe-router-load-balancing-type where not megatron-core's
    # aux_loss (per batch): a Pai line trains with these, whatever config.json says
    moe_aux_loss: float | None = None
    moe_balancing: str | None = None


@dataclass(frozen=True)
class ModelFamily:
    name: str
    summary: str                                   # one line, for docs tables and `mpatch info`
    hf_model_types: tuple[str, ...]
    hf_architectures: tuple[str, ...]
    parse_config: Callable[[dict], Arch]
    # The config.json fields parse_config reads (and the family's other readers: MTP layers), each with its check
    # (models/config_checks.py: name -> rule, a Table for a nested object); checked before the family reads them.
    config_keys: Mapping[str, object]
    weight_rules: Callable[[Arch], list[Rule]]
    tiny_config: dict
    presets: Mapping[str, dict]                    # MODEL_SIZE -> HF config.json dict
    transformer_config_kwargs: Callable[[Arch], dict] = _no_extra_config
    # Parallel sizes the launcher takes after CP, in order: () dense, ("EP",), ("ETP", "EP") for MoE.
    launcher_parallel_args: tuple[str, ...] = ()
    # Further sets of those the family's launcher also takes, told apart by the argument count: a family that grew
    # experts keeps its dense command lines working (Gemma 4: (), and ("ETP", "EP") for its MoE block).
    launcher_more_parallel_args: tuple[tuple[str, ...], ...] = ()
    # Pai-Megatron-Patch's MODEL_SIZE names for presets named otherwise here ("A3B" -> "30B-A3B"): every launcher
    # that takes the family's sizes takes these too.
    size_aliases: Mapping[str, str] = field(default_factory=dict)
    # Pai's launcher scripts that train this family (training/launcher_args.py merges those at one path).
    pai_launchers: tuple[PaiLauncher, ...] = ()
    # The AdamW weight decay a run defaults to (MP_WEIGHT_DECAY): what Pai's launcher for the family passes.
    weight_decay: float = 0.1
    hf_modules: HFModules = HFModules()
    # HF tensors that are not weights (regular expressions, matched in full).
    ignored_hf_names: tuple[str, ...] = (r"(.+\.)?rotary_emb\.inv_freq",)
    # HF tensors the MCore model does not hold but that travel with it, unchanged (Qwen3.5's vision tower;
    # regular expressions, matched in full): convert/carried.py.
    hf_carried: tuple[str, ...] = ()
    # Where transformers renames a checkpoint's tensors as it loads them, as (prefix on disk, prefix in the loaded
    # model), ``{layer}`` standing for a layer's number: peft names an adapter by the loaded model's module (Gemma 3's
    # multimodal language model is stored under language_model.model. and loaded at model.language_model.;
    # DeepSeek-V4's model.layers.N.attn.wq_a.weight is loaded as model.layers.N.self_attn.q_a_proj.weight).
    hf_loaded_prefixes: tuple[tuple[str, str], ...] = ()
    # HF modules a peft adapter may name but whose LoRA this family cannot reproduce, as peft names them relative to
    # a decoder layer -> why, the one line that refuses such an adapter (DeepSeek-V4's grouped o_a_proj).
    lora_refused: Mapping[str, str] = field(default_factory=dict)
    test_layouts: TestLayouts = field(default_factory=TestLayouts)
    # Why `mpatch align --dtype fp8` has no floor on the HF side for it (the one line that refuses it): an HF model
    # whose GEMMs torchao cannot put in float8 as MCore's are (DeepSeek-V4's attention); None: it has one.
    fp8_align_refused: str | None = None
    # Why its layers cannot run activation recompute ``mode`` ("sel", "full") on this megatron-core release line, the
    # one line the launcher refuses it with before any rank starts; None: they can.
    recompute_refused: Callable[[Arch, str, tuple[int, ...]], str | None] = _no_recompute_limits
    # A view of an HF folder's reader that shows its tensors under the names the weight table reads, for a family
    # whose hub files are named otherwise than transformers saves them (DeepSeek-V4's): reader -> reader, applied
    # before any dequantization; None: the names on disk are the table's.
    hf_names_view: Callable | None = None
    # Multi-token-prediction layers an HF checkpoint carries after the decoder's (DeepSeek-V3: 1); the
    # converter keeps them only when asked, and otherwise drops them saying so.
    hf_mtp_layers: Callable[[dict], int] = _no_mtp_layers
    # Where those layers' HF tensors are (name prefixes, for ``count`` layers): after the decoder's layers in
    # DeepSeek-V3's layout, under ``mtp.`` in Qwen3-Next's.
    hf_mtp_prefixes: Callable[[Arch, int], tuple[str, ...]] = _layers_after_decoder
    # Whether those layers are carried, not built: kept (``--mtp``), their tensors travel beside the MCore model
    # unchanged (convert/carried.py) and are written back on export, but no MTP block is built or trained
    # (DeepSeek-V4's, whose MTP layer megatron-core's block does not express yet).
    hf_mtp_carried: bool = False
    # HF tensors that are copies of others (an MTP layer's embedding and head): checked equal on the way
    # in, written again on the way out.
    hf_copies: Callable[[Arch], dict[str, str]] = _no_copies
    # HF tensors that hold its table's per-expert tensors stacked on dim 0 (gpt-oss's experts as transformers
    # stores them): stacked name -> member names in order (models/mapping/stacks.py).
    hf_stacked: Callable[[Arch], dict[str, tuple[str, ...]]] = _no_stacks
    # The megatron-core layer spec, for a family whose layers need modules of their own (arch, TransformerConfig,
    # use_te, vp_stage, core_attention) -> spec; None: the builder's standard spec (models/blocks/builder.py: layer_spec).
    layer_spec: Callable | None = None
    # Its multi-token-prediction block's spec where megatron-core's would not fit its layers (arch, config, the
    # decoder's spec, use_te, vp_stage) -> spec; None: megatron-core's around the last decoder layer.
    mtp_block_spec: Callable | None = None
    # The model-level pieces it owns, around megatron-core's GPTModel (the embedding's scale, a rotary embedding per
    # layer type, logit soft-capping): (model, arch) -> None, called on every model the builder builds, after
    # megatron-core built it and its RoPE frequencies are in (models/builder.py); None: megatron-core's as built.
    finish_model: Callable | None = None
    # Why a conversion asks megatron-core for this family's model skeleton (a helper process, 5-10 s, cached on
    # disk) instead of deriving it from the weight table (models/derived_skeleton.py); None: it derives. A test
    # holds each family to this (tests/test_family_seams.py), so no family falls back to the slow path unsaid.
    skeleton_from_megatron_core: str | None = None
    # A tiny model's stored buffer that random numbers would not make valid (DeepSeek-V4's hash tables: k distinct
    # experts per token), drawn by the family: (config.json, name, buffer) -> its value, or None (drawn as the
    # others: floats at random, integers as transformers initialises them); models/description/tiny.py.
    tiny_buffer: Callable | None = None
    # The transformers auto class whose model its hub checkpoints hold (tiny checkpoints are made with it):
    # Qwen3.5's is the multimodal model, of which the family converts and trains the language model.
    hf_auto_class: str = "AutoModelForCausalLM"
    # model_type -> the name transformers knows its code under, for a type that only remote code would
    # load (Kimi-K2: kimi_k2 -> deepseek_v3); the aligner builds transformers' own class (models/description/hf_model.py).
    transformers_model_types: Mapping[str, str] = field(default_factory=dict)

    @property
    def hf_defaults(self) -> Mapping[str, Mapping[str, object]]:
        """transformers' class defaults its ``parse_config`` fills in where config.json leaves a field out, by
        model_type (models/description/hf_defaults.py); {}: none differ from the family's own fallbacks."""
        return getattr(self.parse_config, "hf_defaults", {})

    @property
    def hf_defaults_within(self) -> str | None:
        """The nested table those defaults go into (Qwen3.5's text_config), None: config.json's top level."""
        return getattr(self.parse_config, "hf_defaults_within", None)

    @property
    def has_mtp(self) -> bool:
        """Whether its hub checkpoints may carry multi-token-prediction layers (converted with --mtp)."""
        return self.hf_mtp_layers is not _no_mtp_layers

    @property
    def builds_mtp(self) -> bool:
        """Whether the MTP layers it converts with --mtp are built into the MCore model (not only carried)."""
        return self.has_mtp and not self.hf_mtp_carried

    @property
    def launcher(self) -> str:
        return f"examples/{self.name}/run_mcore_{self.name}.sh"

    def hf_reader(self, reader):
        """``reader`` as the weight table reads it (``hf_names_view``)."""
        return reader if self.hf_names_view is None else self.hf_names_view(reader)

    def is_ignored(self, hf_name: str) -> bool:
        return any(re.fullmatch(p, hf_name) for p in self.ignored_hf_names)

    def is_carried(self, hf_name: str) -> bool:
        return any(re.fullmatch(p, hf_name) for p in self.hf_carried)

    def hf_mtp_names(self, arch: Arch, names) -> set[str]:
        """Those of ``names`` that belong to the multi-token-prediction layers config.json declares."""
        count = self.hf_mtp_layers(arch.hf_config)
        prefixes = self.hf_mtp_prefixes(arch, count) if count else ()
        return {n for n in names if n.startswith(prefixes)} if prefixes else set()

    def tied_hf_names(self, arch: Arch) -> dict[str, str]:
        """HF name -> the HF name it must equal, when ``arch`` ties its embeddings (else empty)."""
        return tied_hf_names(self.weight_rules(arch)) if arch.tie_word_embeddings else {}
