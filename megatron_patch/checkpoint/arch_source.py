"""Which model a Megatron-Core checkpoint holds: ``open_checkpoint(path, hf_config=, family=)``.

The architecture comes from the first source that exists, never from guesses:

1. this project's sidecar ``mpatch_checkpoint.json``;
2. ``hf_config``: an HF config.json (or its folder, or the dict) giving the architecture to export into;
3. Megatron-LM's saved ``args`` (legacy: in model_optim_rng.pt; torch_dist: in common.pt), mapped to
   the HF config of the family named by ``family`` (``models.description.megatron_args``);
4. otherwise one line saying which of these to give.

Sources 2 and 3 are checked against the tensors (``checkpoint.foreign``), and every disagreement is
named (hidden size, layers, heads, query groups, MLP size, vocabulary, tied output layer, qk norm,
experts, biases). The tensors give only the attention widths, which 4 heads of 16 and 8 heads of 8
share (q/k/v would be exported permuted): the heads, query groups and head dim are held to the saved
arguments where the checkpoint has them, and a note says the split is the config's where it has none. A
config given for a checkpoint with a sidecar is not used; one that describes another model is noted.
The vocabulary padding is the checkpoint's own (Megatron-LM pads to a multiple of 128 x TP): the model
is described with exactly its rows (``Arch.vocab_padded_to``) and the padding rows are dropped on
export, the true vocabulary being the config's. The result is a ``Sidecar`` like the one this project
writes, so everything downstream (mcore2hf, align, the launcher) reads any checkpoint alike.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from megatron_patch.checkpoint.engine import plan
from megatron_patch.checkpoint.foreign import FoundCheckpoint, find_checkpoint, tensor_facts
from megatron_patch.checkpoint.outputs import carried_files
from megatron_patch.checkpoint.sidecar import SIDECAR_NAME, Sidecar
from megatron_patch.checkpoint_files.layout import TRAIN_STATE
from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import SLIDING_ATTENTION, Arch, read_config_json, validate_layout
from megatron_patch.models.description.megatron_args import (hf_config_from_megatron_args, rope_variants,
                                                              saved_attention_window, saved_number, unbuilt_math)
from megatron_patch.models.description.registry import get_family, parse_arch
from megatron_patch.runtime.distributed import ParallelLayout

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).


@dataclass
class OpenedCheckpoint:
    found: FoundCheckpoint
    sidecar: Sidecar                    # this project's, or one made from the architecture source
    source: str                         # where the architecture came from, in words
    notes: list[str] = field(default_factory=list)

    @property
    def sidecar_dir(self) -> Path:
        """Where the side files (tokenizer, ...) the sidecar lists lie."""
        return self.found.sidecar_dir or self.found.root

    @property
    def model_arch(self) -> Arch:
        """The model alignment and training build from it: the checkpoint's, without a multi-token-
        prediction block it may hold (docs/deepseek.md), with its vocabulary padding."""
        return dataclasses.replace(self.sidecar.arch, mtp_layers=0)


def what_to_give(found: FoundCheckpoint, config_option: str = "--hf-config", family_option: str | None = "--family"
                 ) -> str:
    """What ``open_checkpoint`` still needs for this folder, in words ('' when nothing), in the options of the
    command that asks (``family_option`` None: it takes none; mcore2hf reads saved arguments as a family's)."""
    if found.sidecar_dir is not None:
        return ""
    beside = found.hf_config_beside
    hint = f" ({beside} lies beside the weights)" if beside else ""
    if (found.folder / TRAIN_STATE).is_file():  # a run of this project: its export describes itself
        hint += "; or convert the run's final export (OUTPUT_BASEPATH/final), which has one"
    if found.args is not None and family_option is not None:
        return (f"{family_option} NAME, to read its saved Megatron-LM arguments as that family's model (plus "
                f"{config_option} if they lack the true vocab_size), or {config_option} PATH" + hint)
    if found.args is not None:
        hint += ("; or `mpatch convert mcore2hf --family NAME` reads its saved Megatron-LM arguments as that family's "
                 "model, into an HF folder that describes itself")
    return f"{config_option} PATH: the HF config.json of the model it holds{hint}"


def open_checkpoint(path: str | Path, hf_config: dict | str | Path | None = None, family: str | None = None,
                    iteration: int | None = None, config_option: str = "--hf-config",
                    family_option: str | None = "--family", verify: bool = True) -> OpenedCheckpoint:
    """The checkpoint at ``path`` with its architecture (see the module docstring for the order). ``config_option``
    and ``family_option``: what the asking command calls ``hf_config`` and ``family`` (None: it takes no family),
    for its messages; ``verify``: as ``find_checkpoint``'s."""
    source = "the model's HF config"
    if hf_config is not None and not isinstance(hf_config, dict):
        # Read whether or not it is needed: a --hf-config that names nothing usable is refused, never ignored.
        source = f"{config_option} {hf_config}"
        hf_config = read_config_json(hf_config, hint=f"{config_option} takes the model's HF config.json or the folder "
                                                      "that holds it")
    found = find_checkpoint(path, iteration, verify)
    if found.sidecar_dir is not None:  # this project's own record wins over any other source
        sidecar = found.sidecar
        if family is not None and family != sidecar.family:
            raise UserError(f"{found.sidecar_dir / SIDECAR_NAME} says {sidecar.family}, not {family}, the family asked for")
        notes = [] if hf_config is None else _unused_config_notes(hf_config, sidecar, source,
                                                                  found.sidecar_dir / SIDECAR_NAME)
        return OpenedCheckpoint(found, sidecar, f"{found.sidecar_dir / SIDECAR_NAME}", notes)
    notes: list[str] = []
    if hf_config is not None:
        arch = parse_arch(hf_config)
        if family is not None and family != arch.family:
            raise UserError(f"{source} describes a {arch.family} model, not {family}, the family asked for")
    elif found.args is not None and family is not None:
        config, notes = hf_config_from_megatron_args(found.args, get_family(family))
        arch = get_family(family).parse_config(config)
        source = f"the saved Megatron-LM arguments, as {family}"
    else:
        raise UserError(f"{found.folder} has no {SIDECAR_NAME} to say what model it holds: give "
                        f"{what_to_give(found, config_option, family_option)}")
    arch = _with_stored_mtp_layers(check_architecture(arch, found, source), found, source)
    notes += _unchecked_head_split_notes(arch, found, source)
    fmt_layout = found.layout or ParallelLayout()
    if found.fmt == "legacy":
        _check_legacy_fits(arch, found)

    sidecar = Sidecar.create(found.fmt, arch, fmt_layout, found.dtype, carried_files=carried_files(found.root),
                             num_tensors=found.num_tensors, num_bytes=found.num_bytes,
                             source=f"{found.writer}: {found.folder}", notes=notes)
    return OpenedCheckpoint(found, sidecar, source, notes)


_MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.")


def _with_stored_mtp_layers(arch: Arch, found: FoundCheckpoint, source: str) -> Arch:
    """``arch`` with the multi-token-prediction layers the checkpoint stores (megatron-core's ``mtp.layers.N.*``),
    which a sidecar would count: at most the ones the config declares, for a family that builds them."""
    stored = {int(m.group(1)) for key in found.shapes if (m := _MTP_LAYER.match(key))}
    if not stored:
        return arch
    family = get_family(arch.family)
    declared = family.hf_mtp_layers(arch.hf_config) if family.builds_mtp else 0
    if len(stored) > declared:
        raise UserError(f"{found.folder} holds {len(stored)} multi-token-prediction layer(s), and {source} declares "
                        f"{declared}: give the config.json of the model it holds")
    return dataclasses.replace(arch, mtp_layers=len(stored))


def _check_legacy_fits(arch: Arch, found: FoundCheckpoint) -> None:
    counts = set(found.layers_per_stage)
    if len(counts) > 1:
        raise UserError(f"{found.folder}: its pipeline stages hold {'+'.join(map(str, found.layers_per_stage))} "
                        "layers; only even stages convert from the legacy format")
    validate_layout(arch, found.layout)


def check_architecture(arch: Arch, found: FoundCheckpoint, source: str) -> Arch:
    """``arch`` with the checkpoint's vocabulary padding, after every named disagreement between it
    and the tensors has been refused (all of them in one line)."""
    have, want = tensor_facts(found.shapes), _arch_facts(arch)
    if found.layout is not None and found.layout.pp > 1:
        # A legacy last stage holds output_layer.weight whether or not it is tied to the embedding.
        have.pop("tied output layer")
    wrong, differ = [], []
    for name, expected in want.items():
        got = have.get(name)
        if got is None or got == expected:
            continue
        differ.append(name)
        wrong.append(_describe(name, expected, got, arch))
    if not {"attention width", "key/value width"} & set(differ):
        # Widths that fit still split otherwise (8 heads of 8 for 4 of 16): the saved arguments say how.
        saved = _saved_head_split(found.args)
        wrong += [f"{name}: config {expected}, saved arguments {saved[name]}"
                  for name, expected in _head_split(arch).items() if saved.get(name, expected) != expected]
    wrong += _position_and_norm_disagreements(arch, found.args)
    rows = have.get("embedding rows")
    if rows is not None and rows < arch.vocab_size:
        wrong.append(f"vocabulary: {source} has {arch.vocab_size} tokens, the embedding only {rows} rows")
    if wrong:
        raise UserError(f"{found.folder} does not hold the model {source} describes: " + "; ".join(wrong))
    if rows is not None and rows != arch.padded_vocab_size():
        arch = dataclasses.replace(arch, vocab_padded_to=rows)
    return arch


def _describe(name: str, expected, got, arch: Arch) -> str:
    if name == "attention width":
        return (f"attention heads: config {arch.num_heads} x head dim {arch.head_dim} = {expected}, tensors {got}"
                + (f" ({got // arch.head_dim} heads)" if got % arch.head_dim == 0 else ""))
    if name == "key/value width":
        return (f"query groups: config {arch.num_kv_heads} (key/value rows {expected}), tensors {got} rows"
                + (f" ({got // (2 * arch.head_dim)} groups)" if got % (2 * arch.head_dim) == 0 else ""))
    if isinstance(expected, bool):
        return f"{name}: config {'yes' if expected else 'no'}, tensors {'yes' if got else 'no'}"
    return f"{name}: config {expected}, tensors {got}"


def _arch_facts(arch: Arch) -> dict:
    names = {p.mcore_name for t in plan(get_family(arch.family), arch, ParallelLayout()) for p in t.placements}
    facts = {"hidden size": arch.hidden_size, "layers": arch.num_layers, "experts": arch.num_experts,
             "tied output layer": arch.tie_word_embeddings,
             "qk norm": any(n.endswith("self_attention.q_layernorm.weight") for n in names),
             "linear biases": any(n.endswith("self_attention.linear_qkv.bias") for n in names)}
    if arch.mla is None:
        facts["attention width"] = arch.num_heads * arch.head_dim
        facts["key/value width"] = 2 * arch.num_kv_heads * arch.head_dim
    if not arch.is_moe:
        facts["MLP size"] = arch.ffn_hidden_size
    return facts


# --- how the attention width splits into heads -------------------------------------------------------

def _head_split(arch: Arch) -> dict:
    """The heads, query groups and head dim the config splits the attention widths into (none for
    multi-latent attention, whose widths are not checked either)."""
    if arch.mla is not None:
        return {}
    return {"attention heads": arch.num_heads, "query groups": arch.num_kv_heads, "head dim": arch.head_dim}


def _saved_head_split(args: dict | None) -> dict:
    """What Megatron-LM's saved arguments (Pai-Megatron-Patch's too) say of the split, as ``_head_split``
    names it; a value that is not a positive whole number says nothing (the arguments are untrusted input)."""
    def whole(key: str) -> int | None:
        value = (args or {}).get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    heads, hidden = whole("num_attention_heads"), whole("hidden_size")
    if heads is None:
        return {}
    # Megatron-LM's own defaults: one group per head without --group-query-attention, kv_channels = hidden / heads.
    groups = whole("num_query_groups") if (args or {}).get("group_query_attention") else heads
    head_dim = whole("kv_channels") or (hidden // heads if hidden else None)
    split = {"attention heads": heads, "query groups": groups, "head dim": head_dim}
    return {name: value for name, value in split.items() if value is not None}


def _position_and_norm_disagreements(arch: Arch, args: dict | None) -> list[str]:
    """What the saved Megatron-LM arguments say of the model's math beside its shapes (its RoPE base, scaling and
    share of each head, its norm's epsilon) where a config says otherwise: a config of the base model given for a
    run trained without --use-rope-scaling changed every logit without a word. A value that is not a number says
    nothing (the arguments are untrusted input)."""
    if not args:
        return []

    wrong = [f"{variant} in the saved arguments, which no family here builds"
             for variant in rope_variants(args) + unbuilt_math(args)]
    window = saved_attention_window(args, arch.num_layers)
    ours = tuple(kind == SLIDING_ATTENTION for kind in arch.layer_types)
    if isinstance(window, str):
        wrong.append(f"{window} in the saved arguments, which no family here builds")
    elif window is not None and (window[0], window[1]) != (arch.sliding_window, ours):
        # a Mistral run's --window-size was dropped: the export attended over every key (the pdoc audit)
        config = (f"{arch.sliding_window} keys on {sum(ours)} of {len(ours)} layers" if any(ours) else "none")
        wrong.append(f"sliding-window attention: config {config}, saved arguments {window[0]} keys on "
                     f"{sum(window[1])} of {len(window[1])} layers (--window-size, --window-attn-skip-freq)")
    theta, eps, percent = (saved_number(args, key) for key in ("rotary_base", "norm_epsilon", "rotary_percent"))
    if theta is not None and theta != arch.rope_theta:
        wrong.append(f"RoPE base: config {arch.rope_theta:g}, saved arguments {theta:g}")
    if eps is not None and not math.isclose(eps, arch.norm_eps, rel_tol=1e-6):
        wrong.append(f"norm epsilon: config {arch.norm_eps:g}, saved arguments {eps:g}")
    if percent is not None and not math.isclose(percent, arch.rotary_percent):
        wrong.append(f"RoPE share of each head: config {arch.rotary_percent:g}, saved arguments {percent:g} "
                     "(--rotary-percent)")
    rope_type = (arch.rope_scaling or {}).get("rope_type", "default")
    if isinstance(args.get("use_rope_scaling"), bool) and rope_type in ("default", "llama3"):
        said, configured = args["use_rope_scaling"], rope_type == "llama3"
        if said != configured:
            wrong.append(f"llama3 RoPE scaling: config {'yes' if configured else 'no'}, saved arguments "
                         f"{'yes' if said else 'no'} (--use-rope-scaling)")
        factor, ours = saved_number(args, "rope_scaling_factor"), (arch.rope_scaling or {}).get("factor")
        if said and configured and factor is not None and isinstance(ours, (int, float)) and factor != ours:
            wrong.append(f"llama3 RoPE scaling factor: config {ours:g}, saved arguments {factor:g} "
                         "(--rope-scaling-factor)")
    return wrong


def _unchecked_head_split_notes(arch: Arch, found: FoundCheckpoint, source: str) -> list[str]:
    """One note where nothing in the checkpoint says how its checked widths split into heads."""
    split = _head_split(arch)
    if not split or "attention heads" in _saved_head_split(found.args):
        return []
    return [f"nothing in {found.folder} records its attention heads (no saved Megatron-LM arguments say them): only "
            f"the attention widths were checked against its tensors, and their split into {arch.num_heads} heads of "
            f"{arch.head_dim} with {arch.num_kv_heads} query groups is taken from {source}"]


def _unused_config_notes(config: dict, sidecar: Sidecar, source: str, sidecar_path: Path) -> list[str]:
    """One note where a config given for a checkpoint that describes itself describes another model: the
    sidecar, written from and checked against these weights, is what is used."""
    try:
        given = parse_arch(config)
    except UserError as exc:
        differs = f"it does not read as a model: {exc}"
    else:
        own = sidecar.arch
        fields = [f.name for f in dataclasses.fields(Arch)
                  if f.compare and f.name not in ("mtp_layers", "vocab_padded_to")
                  and getattr(given, f.name) != getattr(own, f.name)]
        if not fields:
            return []
        differs = "; ".join(f"{name}: config {getattr(given, name)}, sidecar {getattr(own, name)}"
                            for name in fields[:4]) + ("; ..." if len(fields) > 4 else "")
    return [f"{source} is ignored: {sidecar_path} describes the model this checkpoint holds, and the config "
            f"describes another ({differs})"]
