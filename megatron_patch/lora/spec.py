"""What a LoRA run asks for, in one typed value: from the launcher's MP_LORA_* extras, or from a peft
adapter's adapter_config.json (peft's own field meanings), each value checked on its own in one line.

Rank and alpha per module follow peft's rules exactly (``rank_pattern`` / ``alpha_pattern`` are regular
expressions matched against the end of a module's name), so a module gets here the rank and scaling
peft gives it.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_patch.errors import UserError
from megatron_patch.input_files import read_json_object
from megatron_patch.models.mapping import LORA_TARGETS

DEFAULT_TARGETS = ("qkv", "proj", "fc1", "fc2")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraSpec:
    """The adapters asked for. ``modules``: exactly these peft module names (an imported adapter, which may
    cover only some of a fused layer's modules, e.g. q_proj and v_proj); None: every module of ``targets``."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    use_rslora: bool = False
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    # peft's layers_to_transform: the decoder layers whose modules take adapters (peft applies it to
    # target_modules, not to target_parameters, and so does this).
    layers: tuple[int, ...] | None = None
    modules: tuple[str, ...] | None = None
    # peft's modules_to_save: HF modules trained whole and saved with the adapter.
    modules_to_save: tuple[str, ...] = ()

    def rank_alpha(self, name: str) -> tuple[int, float]:
        """(rank, alpha) of the module (or stacked parameter) ``name``, as peft's LoraModel picks them."""
        return (self.rank_pattern.get(_pattern_key(self.rank_pattern, name), self.rank),
                self.alpha_pattern.get(_pattern_key(self.alpha_pattern, name), self.alpha))

    def scaling(self, rank: int, alpha: float) -> float:
        """What B @ A is multiplied by: alpha / rank, or alpha / sqrt(rank) with rsLoRA."""
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "the checkpoint's LoRA record") -> "LoraSpec":
        """A spec as ``to_dict`` wrote it into a checkpoint's sidecar (untrusted: each field's type checked, one line
        naming ``where`` and the field otherwise)."""
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        bad = next((k for k, ok in _RECORD_CHECKS.items() if k in known and not ok(known[k])), None)
        if bad is not None or not {"rank", "alpha"} <= set(known):
            raise UserError(f"{where}: its spec's {bad or 'rank or alpha'!r} is "
                            f"{'missing' if bad is None else 'of the wrong type or value'}: the checkpoint's sidecar "
                            "is damaged")
        for key in ("targets", "layers", "modules", "modules_to_save"):
            if known.get(key) is not None:
                known[key] = tuple(known[key])
        return cls(**known)

    def describe(self) -> str:
        pattern = " with per-module ranks/alphas" if self.rank_pattern or self.alpha_pattern else ""
        return (f"rank {self.rank}, alpha {self.alpha:g}{' (rsLoRA)' if self.use_rslora else ''}{pattern}, dropout "
                f"{self.dropout:g}, targets {','.join(self.targets)}"
                + (f", layers {list(self.layers)}" if self.layers is not None else "")
                + (f", modules_to_save {list(self.modules_to_save)}" if self.modules_to_save else ""))


def _finite(value) -> bool:
    # Python's json (and so peft) reads NaN and Infinity: int() of them raises, and an alpha of them merges
    # into NaN weights, so they are refused with the other non-numbers before anything converts them.
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _strings(v) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v)


def _patterns(v) -> bool:
    """A rank_pattern or alpha_pattern: a dict whose keys are regular expressions (one that is not was an internal
    error in both exports: the lora audit)."""
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        return False
    try:
        for key in v:
            re.compile(key)
    except re.error:
        return False
    return True


# Each field of a spec read back from a sidecar, and what it must be.
_RECORD_CHECKS = {
    "rank": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
    "alpha": _finite, "dropout": lambda v: _finite(v) and 0 <= v < 1, "targets": _strings,
    "use_rslora": lambda v: isinstance(v, bool),
    "rank_pattern": lambda v: _patterns(v) and all(isinstance(r, int) and not isinstance(r, bool) and r > 0
                                                   for r in v.values()),
    "alpha_pattern": lambda v: _patterns(v) and all(_finite(a) for a in v.values()),
    "layers": lambda v: v is None or (isinstance(v, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool)
                                                                  for i in v)),
    "modules": lambda v: v is None or _strings(v), "modules_to_save": _strings,
}


def _pattern_key(patterns: dict, name: str) -> str:
    """peft's ``get_pattern_key``: the first pattern that matches the end of ``name`` at a dot boundary."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return name


def parse_targets(raw: str) -> tuple[str, ...]:
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    bad = [p for p in parts if p not in LORA_TARGETS]
    if not parts or bad:
        raise UserError(f"MP_LORA_TARGETS must be a comma list out of {','.join(LORA_TARGETS)}, got '{raw}'")
    return tuple(dict.fromkeys(parts))


# --- peft's adapter_config.json --------------------------------------------------------------------------------

# peft fields whose non-default value changes what the adapter computes and is not supported here.
_REFUSED = {
    "use_dora": (False, "DoRA (use_dora) is not supported: its magnitude vector needs the merged weight's norm per "
                        "column, which a TP shard does not have (docs/lora.md)"),
    "lora_bias": (False, "lora_bias=true (a bias on lora_B) is not supported: use bias=\"none\""),
    "fan_in_fan_out": (False, "fan_in_fan_out=true is for GPT-2's Conv1D layers, which no family here has"),
    "layer_replication": (None, "layer_replication is not supported: the model's layers are built as config.json says"),
    "trainable_token_indices": (None, "trainable_token_indices is not supported: use modules_to_save for embeddings"),
    "use_qalora": (False, "QA-LoRA (use_qalora) is not supported: it belongs to quantized base models"),
    "use_bdlora": (None, "block-diagonal LoRA (use_bdlora) is not supported"),
    "alora_invocation_tokens": (None, "activated LoRA (alora_invocation_tokens) is not supported"),
    "exclude_modules": (None, "exclude_modules is not supported: list the target modules instead"),
}


def read_adapter_config(folder: str | Path) -> dict:
    hint = f"give a peft adapter folder (adapter_config.json and {ADAPTER_WEIGHTS})"
    if not Path(folder).is_dir():
        raise UserError(f"{folder} is not a folder: {hint}")
    return read_json_object(Path(folder) / ADAPTER_CONFIG, inside=folder, hint=hint)


def spec_from_peft_config(data: dict, where: str) -> LoraSpec:
    """A ``LoraSpec`` from peft's config fields (``modules`` and ``targets`` are filled in from the adapter's
    tensors by ``peft_io``); anything that changes the function and is not supported is refused."""
    if data.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{where}: peft_type {data.get('peft_type')!r} is not LoRA; only LoRA adapters are supported")
    if data.get("bias", "none") != "none":
        raise UserError(f"{where}: bias={data.get('bias')!r} is not supported: only bias=\"none\" adapters (peft's "
                        "default) convert exactly")
    for key, (default, why) in _REFUSED.items():
        value = data.get(key, default)
        if value not in (default, None, False, [], {}):
            raise UserError(f"{where}: {why}")
    task = data.get("task_type")
    if task not in (None, "CAUSAL_LM"):
        raise UserError(f"{where}: task_type {task!r} is not supported: the models here are causal language models")

    def number(key, kind, default=None):
        value = data.get(key, default)
        if not _finite(value) or (kind is int and value != int(value)):
            raise UserError(f"{where}: {key} must be a{'n integer' if kind is int else ' finite number'}, "
                            f"found {value!r}")
        return kind(value)

    rank = number("r", int, 8)
    if rank < 1:
        raise UserError(f"{where}: r must be >= 1, found {rank}")
    # peft's forms (a malformed one was an internal error): target_modules a regular expression or a list of names,
    # target_parameters a list of names
    modules, parameters = data.get("target_modules"), data.get("target_parameters")
    if not (modules is None or isinstance(modules, str) or _strings(modules)):
        raise UserError(f"{where}: target_modules must be a regular expression or a list of module names, "
                        f"found {str(modules)[:80]}")
    if isinstance(modules, str) and modules != "all-linear":
        try:
            re.compile(modules)
        except re.error as exc:
            raise UserError(f"{where}: target_modules {modules[:80]!r} is not a regular expression ({exc})")
    if not (parameters is None or _strings(parameters)):
        raise UserError(f"{where}: target_parameters must be a list of parameter names, found {str(parameters)[:80]}")
    patterns = {}
    for key, kind in (("rank_pattern", int), ("alpha_pattern", float)):
        raw = data.get(key) or {}
        if not isinstance(raw, dict):
            raise UserError(f"{where}: {key} must be an object of pattern -> value, found {raw!r}")
        for pattern in raw:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise UserError(f"{where}: {key} has an invalid regular expression {pattern!r} ({exc})")
        patterns[key] = {k: number_of(v, kind, f"{where}: {key}[{k!r}]") for k, v in raw.items()}
    layers = data.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and (not isinstance(layers, list) or not all(isinstance(i, int) for i in layers)):
        raise UserError(f"{where}: layers_to_transform must be an integer or a list of integers, found {layers!r}")
    pattern = data.get("layers_pattern")
    if pattern not in (None, "", [], "layers", ["layers"]):
        raise UserError(f"{where}: layers_pattern {pattern!r} is not supported: these models number their decoder "
                        "layers under 'layers'")
    saved = data.get("modules_to_save") or []
    if not isinstance(saved, list) or not all(isinstance(m, str) for m in saved):
        raise UserError(f"{where}: modules_to_save must be a list of module names, found {saved!r}")
    dropout = number("lora_dropout", float, 0.0)
    if not 0 <= dropout < 1:
        raise UserError(f"{where}: lora_dropout must be in [0, 1), found {dropout}")
    return LoraSpec(rank=rank, alpha=number("lora_alpha", float, 8), dropout=dropout,
                    use_rslora=bool(data.get("use_rslora", False)), rank_pattern=patterns["rank_pattern"],
                    alpha_pattern=patterns["alpha_pattern"], layers=None if layers is None else tuple(layers),
                    modules_to_save=tuple(saved))


def number_of(value, kind, what: str):
    if not _finite(value) or (kind is int and value != int(value)) or value <= 0:
        raise UserError(f"{what} must be a positive {'integer' if kind is int else 'finite number'}, found {value!r}")
    return kind(value)
