"""Every config.json value is checked before anything uses it: its type, its range, and, for the sizes, that the
weights on disk can hold the model it describes.

A config.json is untrusted input like the rest of a checkpoint. The families read it with ``raw.get``; this
module runs first (``registry.parse_arch``), so a string where a number belongs, a negative epsilon, a NaN,
zero key/value heads or a billion layers is refused in one line naming the field, instead of a traceback, a
silently wrong model, or an allocation proportional to the bad number.

- ``check_config_values(raw, keys)``: the fields every config has and those its family declares it reads
  (``ModelFamily.config_keys``, in the family's folder), by type and range, nested tables included (JSON ``null``
  means "not given": the families' defaults apply).
- Structural sizes have ceilings far beyond any published model (layers 10,000, vocabulary 2**31...): the
  work before a model is built (layer lists, the weight plan) is proportional to them.
- ``least_weight_elements(arch)``: a lower bound of the model's weights from the config alone;
  ``check_weights_fit`` compares it with the bytes the checkpoint's files hold, before anything
  proportional to the model is planned or allocated. Where no weights exist (a preset, a config alone),
  the training memory plan decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_patch.errors import UserError


@dataclass(frozen=True)
class Whole:
    """A whole number in [low, high]."""

    low: int
    high: int

    def problem(self, value) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be a whole number, found {_show(value)}"
        if not self.low <= value <= self.high:
            return f"must be between {self.low} and {self.high:,}, found {value:,}"
        return None


@dataclass(frozen=True)
class Real:
    """A finite number, > low (or >= low with ``closed``), at most ``high``."""

    low: float
    high: float = math.inf
    closed: bool = False

    def problem(self, value) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number, found {_show(value)}"
        if not math.isfinite(value):
            return f"must be a finite number, found {value}"
        if value < self.low or (value == self.low and not self.closed) or value > self.high:
            bound = f">= {self.low:g}" if self.closed else f"> {self.low:g}"
            return f"must be {bound}" + (f" and at most {self.high:g}" if math.isfinite(self.high) else "") + \
                f", found {value:g}"
        return None


@dataclass(frozen=True)
class Flag:
    def problem(self, value) -> str | None:
        return None if isinstance(value, bool) else f"must be true or false, found {_show(value)}"


@dataclass(frozen=True)
class Table:
    """A JSON object whose own fields follow ``fields`` (checked the same way, at any depth)."""

    fields: dict

    def problem(self, value) -> str | None:
        return None if isinstance(value, dict) else f"must be a JSON object, found {_show(value)}"


@dataclass(frozen=True)
class PerLayer:
    """A JSON object from layer numbers to tables whose fields follow ``fields`` (transformers 5's
    ``per_layer_config``: a layer's own settings); its keys being layer numbers, a reader takes them all at once."""

    fields: dict

    def problem(self, value) -> str | None:
        if not isinstance(value, dict) or not all(str(k).isdigit() and isinstance(v, dict) for k, v in value.items()):
            return f"must map layer numbers to JSON objects, found {_show(value)}"
        return None


@dataclass(frozen=True)
class Given:
    """Any value: the family reads only whether the field is given (and refuses it then, in one line)."""

    def problem(self, value) -> str | None:
        return None


@dataclass(frozen=True)
class Text:
    """A string (a name, a model type, an activation)."""

    def problem(self, value) -> str | None:
        return None if isinstance(value, str) else f"must be a string, found {_show(value)}"


@dataclass(frozen=True)
class Names:
    """A list of strings (per-layer types), at most ``longest`` of them."""

    longest: int = 10_000

    def problem(self, value) -> str | None:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return f"must be a list of strings, found {_show(value)}"
        if len(value) > self.longest:
            return f"must list at most {self.longest:,} names, found {len(value):,}"
        return None


@dataclass(frozen=True)
class WholeList:
    """A list of whole numbers in [low, high], at most ``longest`` of them."""

    low: int
    high: int
    longest: int = 10_000

    def problem(self, value) -> str | None:
        if not isinstance(value, list):
            return f"must be a list of whole numbers, found {_show(value)}"
        if len(value) > self.longest:
            return f"must list at most {self.longest:,} numbers, found {len(value):,}"
        for item in value:
            why = Whole(self.low, self.high).problem(item)
            if why:
                return f"must list whole numbers between {self.low} and {self.high:,}, found {_show(item)}"
        return None


def _show(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}" + ("..." if len(text) > 40 else "")


MAX_LAYERS = 10_000
MAX_WIDTH = 2**20           # hidden size, MLP sizes, head dims, LoRA ranks
MAX_HEADS = 2**16
MAX_VOCAB = 2**31 - 1
MAX_EXPERTS = 2**16
MAX_POSITIONS = 2**31 - 1

# RoPE's fields, wherever a config.json keeps them (rope_scaling, rope_parameters, per layer type in Gemma's).
ROPE_FIELDS = {
    "rope_type": Text(), "type": Text(), "rope_theta": Real(0), "factor": Real(0), "low_freq_factor": Real(0),
    "high_freq_factor": Real(0), "original_max_position_embeddings": Whole(1, MAX_POSITIONS), "beta_fast": Real(0),
    "beta_slow": Real(0), "mscale": Real(0, closed=True), "mscale_all_dim": Real(0, closed=True),
    "attention_factor": Real(0), "partial_rotary_factor": Real(0, 1.0), "truncate": Flag(),
}

# The fields every config.json may have and the code outside the families reads: which family claims it, and the
# dtype its weights were saved in. Everything else a family reads, the family declares (``ModelFamily.config_keys``,
# in its folder), and a test holds each family's reads to its declaration (tests/test_family_seams.py).
COMMON_KEYS: dict = {"model_type": Text(), "architectures": Names(), "dtype": Text(), "torch_dtype": Text()}


# What config.json's ``torch_dtype`` (transformers < 5) or ``dtype`` (5.x) may name: the dtype the weights were
# saved in, always a float (a quantized checkpoint names the dtype it dequantizes to).
CONFIG_FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")


def config_dtype(raw: dict, where: str = "config.json") -> str | None:
    """The float dtype config.json names (``dtype``, else ``torch_dtype``), None when it names none; anything
    else is refused in one line."""
    for key in ("dtype", "torch_dtype"):
        value = raw.get(key)
        if value is not None and value not in CONFIG_FLOAT_DTYPES:
            raise UserError(f"{where} '{key}' must name a float dtype ({', '.join(CONFIG_FLOAT_DTYPES)}), found "
                            f"{_show(value)}")
    return raw.get("dtype") or raw.get("torch_dtype")


def check_config_values(raw: dict, keys: dict | None = None, where: str = "config.json") -> None:
    """Refuse the first field whose type or range is wrong, in one line naming it: the fields every config has, and
    ``keys``, the fields a family declares it reads (``ModelFamily.config_keys``)."""
    config_dtype(raw, where)
    _check_fields(raw, {**COMMON_KEYS, **(keys or {})}, where, "")


def _check_fields(raw: dict, rules: dict, where: str, path: str) -> None:
    for key, rule in rules.items():
        value = raw.get(key)
        if value is None:  # JSON null means "not given": the family's default applies
            continue
        why = rule.problem(value)
        if why:
            raise UserError(f"{where} '{path}{key}' {why}")
        if isinstance(rule, Table):
            _check_fields(value, rule.fields, where, f"{path}{key}.")
        if isinstance(rule, PerLayer):
            for layer, fields in value.items():
                _check_fields(fields, rule.fields, where, f"{path}{key}.{layer}.")


def check_arch(arch) -> None:
    """The parsed model, as a backstop for fields a family derived (sizes from products, defaults)."""
    for name in ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "max_position_embeddings"):
        value = getattr(arch, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"config.json gives {name}={value!r}, which must be a positive whole number")
    for name in ("norm_eps", "rope_theta"):
        value = getattr(arch, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise UserError(f"config.json gives {name}={value!r}, which must be a finite number above 0")
    for shape in arch.attention_shapes:
        if isinstance(shape.num_kv_heads, bool) or not isinstance(shape.num_kv_heads, int) or shape.num_kv_heads < 1 \
                or arch.num_heads % shape.num_kv_heads:
            raise UserError(f"config.json has {arch.num_heads} attention heads, not a multiple of its "
                            f"{shape.num_kv_heads} key/value heads")
        if isinstance(shape.head_dim, bool) or not isinstance(shape.head_dim, int) or shape.head_dim < 1:
            raise UserError(f"config.json gives a head_dim of {shape.head_dim!r}, which must be a positive whole "
                            "number")
    # RoPE rotates pairs of dimensions: an odd rotated width fails in megatron-core's and transformers' RoPE alike
    # (an odd partial width is rounded, in both)
    rotated = [("qk_rope_head_dim", arch.mla.qk_rope_head_dim)] if arch.mla else [
        ("head_dim", shape.head_dim) for shape in arch.attention_shapes if arch.rotary_percent >= 1]
    if arch.sparse_attention:
        rotated.append(("index_head_dim's RoPE part", arch.sparse_attention.rope_head_dim))
    for name, width in rotated:
        if width % 2:
            raise UserError(f"config.json gives {name}={width}, which RoPE rotates whole: it must be even")
    if arch.is_moe and arch.moe_topk > arch.num_experts:
        # transformers' router fails on it (torch.topk out of range), megatron-core's too
        raise UserError(f"config.json routes each token to {arch.moe_topk} of its {arch.num_experts} experts: at most "
                        f"{arch.num_experts} can be chosen")


def least_weight_elements(arch) -> int:
    """A lower bound of the weights' element count from the config alone: the embedding, and in every layer
    the attention's output projection and the MLP's up and down projections (each expert's, in MoE layers).
    Every supported architecture has at least these; a family whose files hold less (DeepSeek-V4) gives its own
    (``FamilyConfig.least_weight_elements``)."""
    own = arch.family_config.least_weight_elements(arch) if arch.family_config is not None else None
    if own is not None:
        return own
    moe_layers = arch.num_layers - len(arch.dense_layers) if arch.is_moe else 0
    dense_layers = arch.num_layers - moe_layers
    attention = sum(arch.num_heads * arch.attention_shape(i).head_dim * arch.hidden_size
                    for i in range(arch.num_layers))
    return (arch.vocab_size * arch.hidden_size + attention
            + dense_layers * 2 * arch.ffn_hidden_size * arch.hidden_size
            + moe_layers * arch.num_experts * 2 * arch.moe_ffn_hidden_size * arch.hidden_size)


def check_weights_fit(arch, stored_bytes: int, where: str) -> None:
    """Refuse a config that describes more weights than ``where``'s files can hold (at least one byte per
    element, FP8 included; half a byte where config.json names a quantization, as MXFP4 and FP4 pack two values a
    byte: gpt-oss-120b's hub files hold 65 GB for 77 billion expert weights, and were refused), before any work
    proportional to the model."""
    least = least_weight_elements(arch)
    packed = bool((arch.hf_config or {}).get("quantization_config"))
    if ((least + 1) // 2 if packed else least) > stored_bytes:
        raise UserError(
            f"config.json describes a model of at least {least:,} weights (vocab_size={arch.vocab_size:,}, "
            f"hidden_size={arch.hidden_size:,}, num_hidden_layers={arch.num_layers:,}), but {where} holds "
            f"{stored_bytes:,} bytes: the config and the weights do not belong together")
