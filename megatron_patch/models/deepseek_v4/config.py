"""DeepSeek-V4 (``deepseek_v4``: DeepseekV4ForCausalLM) config.json -> Arch and its own ``DeepseekV4Settings``, as
transformers 5.24 reads it (``DeepseekV4Config``, its ``__post_init__`` included):

- ``layer_types`` per layer, each sliding_attention, compressed_sparse_attention (CSA) or
  heavily_compressed_attention (HCA); else the hub's ``compress_ratios`` (0, 4, 128 per layer, as transformers maps
  them); else transformers' default (two HCA layers, then CSA and HCA alternating, HCA first);
- ``compress_rates`` per compressed type (default CSA 4, HCA 128), the hub's ``compress_rate_csa`` and
  ``compress_rate_hca`` overriding them;
- ``mlp_layer_types`` per layer, hash_moe or moe; else the first ``num_hash_layers`` (default 3) hash_moe;
- ``partial_rotary_factor``, else the hub's ``qk_rope_head_dim / head_dim``, else 64 / 512;
- RoPE: the sliding layers' plain RoPE of ``rope_theta`` ("main"), the compressed layers' of ``compress_rope_theta``
  with the hub's ``rope_scaling`` (YaRN, whose ``attention_factor`` transformers sets to 1.0) ("compress"); or both
  as transformers writes them back (``rope_parameters: {"main": ..., "compress": ...}``).
Lists longer than ``num_hidden_layers`` are cut to it, as transformers does (the hub's ``compress_ratios`` name the
MTP layer too); shorter ones are refused.

Refused in one line: what transformers' model is not, though the config could say it (``num_key_value_heads`` other
than 1: its attention has one shared key/value head; ``n_shared_experts`` other than 1: it builds one shared expert;
``norm_topk_prob=false``: its routers always renormalise the chosen experts' weights; attention or MLP biases; an
activation other than silu), unknown layer types, and RoPE types the compressed layers do not have.
"""

from megatron_patch.errors import UserError
from megatron_patch.models.deepseek_v4.settings import (
    CSA, HASH_MOE, HCA, LAYER_TYPES, MLP_LAYER_TYPES, MOE, SLIDING, DeepseekV4Settings)
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.description.config_checks import (
    MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, ROPE_FIELDS, Flag, Names, Real, Table,
    Text, Whole, WholeList)

# transformers' DeepseekV4Config defaults, for the fields a config.json leaves out.
DEFAULTS = {
    "vocab_size": 129_280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024,
    "num_experts_per_tok": 6, "n_routed_experts": 256, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "max_position_embeddings": 1_048_576,
    "rope_theta": 10_000.0, "compress_rope_theta": 160_000.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "swiglu_limit": 10.0, "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64,
    "index_head_dim": 128, "index_topk": 512, "num_nextn_predict_layers": 1, "router_aux_loss_coef": 0.001,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_hash_layers": 3,
}
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
DEFAULT_PARTIAL_ROTARY_FACTOR = 64 / 512
# The hub's compress_ratios, per layer, as transformers maps them (its _COMPRESS_RATIO_TO_LAYER_TYPE)
COMPRESS_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
# The YaRN fields of the compressed layers' RoPE that transformers reads
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate")


def value(raw: dict, key: str):
    found = raw.get(key)
    return DEFAULTS.get(key) if found is None else found


def _per_layer(name: str, types: list, layers: int, allowed: tuple[str, ...]) -> tuple[str, ...]:
    if len(types) < layers:
        raise UserError(f"config.json {name} names {len(types)} layers, but num_hidden_layers is {layers}: give one "
                        "per layer")
    bad = sorted({t for t in types[:layers] if t not in allowed})
    if bad:
        raise UserError(f"config.json {name} has {', '.join(map(str, bad))}: DeepSeek-V4's layers are each one of "
                        f"{', '.join(allowed)}")
    return tuple(types[:layers])


def layer_types_of(raw: dict, layers: int) -> tuple[str, ...]:
    """Each layer's attention: ``layer_types``, else the hub's ``compress_ratios``, else transformers' default."""
    if raw.get("layer_types") is not None:
        return _per_layer("layer_types", raw["layer_types"], layers, LAYER_TYPES)
    ratios = raw.get("compress_ratios")
    if ratios is not None:
        unknown = sorted({r for r in ratios[:layers] if r not in COMPRESS_RATIO_TYPES})
        if unknown:
            raise UserError(f"config.json compress_ratios has {', '.join(map(str, unknown))}: transformers reads only "
                            f"{', '.join(map(str, COMPRESS_RATIO_TYPES))} (sliding, CSA, HCA); give layer_types instead")
        return _per_layer("compress_ratios", [COMPRESS_RATIO_TYPES[r] for r in ratios], layers, LAYER_TYPES)
    return tuple([HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))])


def mlp_layer_types_of(raw: dict, layers: int) -> tuple[str, ...]:
    """Each layer's MoE block: ``mlp_layer_types``, else the first ``num_hash_layers`` hash-routed."""
    if raw.get("mlp_layer_types") is not None:
        return _per_layer("mlp_layer_types", raw["mlp_layer_types"], layers, MLP_LAYER_TYPES)
    hashed = value(raw, "num_hash_layers")
    return tuple([HASH_MOE] * min(layers, hashed) + [MOE] * max(0, layers - hashed))


def compress_rates_of(raw: dict) -> tuple[tuple[str, int], ...]:
    # field by field, so that the fields read stay known (tests/test_family_seams.py); the names are listed only
    # when there are more than these two, to refuse them
    given = raw.get("compress_rates") or {}
    rates = {t: given[t] if given.get(t) is not None else DEFAULT_COMPRESS_RATES[t] for t in (CSA, HCA)}
    if len(given) > sum(t in given for t in (CSA, HCA)):
        unknown = sorted(set(given) - {CSA, HCA})
        raise UserError(f"config.json compress_rates names {', '.join(unknown)}: only {CSA} and {HCA} compress")
    for key, layer_type in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if raw.get(key) is not None:
            rates[layer_type] = raw[key]
    return tuple(sorted(rates.items()))


def partial_rotary_factor_of(raw: dict) -> float:
    if raw.get("partial_rotary_factor") is not None:
        return float(raw["partial_rotary_factor"])
    if raw.get("qk_rope_head_dim") is not None:
        return raw["qk_rope_head_dim"] / value(raw, "head_dim")
    return DEFAULT_PARTIAL_ROTARY_FACTOR


def ropes_of(raw: dict) -> tuple[float, float, dict | None]:
    """(the sliding layers' theta, the compressed layers' theta, their YaRN fields or None), from either form."""
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = params["main"], params["compress"]
        main_theta = main.get("rope_theta", value(raw, "rope_theta"))
        compress_theta = compress.get("rope_theta", value(raw, "compress_rope_theta"))
        given_attention_factor = True
    else:
        # the hub's form: the flat rope_scaling (or rope_parameters) is the compressed layers'; the sliding layers'
        # RoPE is always plain
        main = {"rope_type": "default"}
        flat = raw.get("rope_scaling") or params
        compress = {k: flat[k] for k in ROPE_FIELDS if flat.get(k) is not None}
        main_theta, compress_theta = value(raw, "rope_theta"), value(raw, "compress_rope_theta")
        given_attention_factor = False
    main_type = main.get("rope_type", main.get("type", "default"))
    if main_type != "default":
        raise UserError(f"RoPE type '{main_type}' on DeepSeek-V4's sliding-window layers is not supported: they have "
                        "plain RoPE")
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise UserError(f"RoPE type '{kind}' on DeepSeek-V4's compressed layers is not supported: choose yarn or "
                        "default")
    if kind == "default":
        return float(main_theta), float(compress_theta), None
    missing = [k for k in ("factor", "original_max_position_embeddings") if compress.get(k) is None]
    if missing:
        raise UserError(f"config.json's YaRN RoPE lacks {', '.join(missing)}")
    yarn = {"rope_type": "yarn", **{k: compress[k] for k in YARN_KEYS if compress.get(k) is not None}}
    if not given_attention_factor:
        yarn.setdefault("attention_factor", 1.0)  # transformers: the V4 reference scales no cos/sin
    return float(main_theta), float(compress_theta), yarn


def check_supported(raw: dict) -> None:
    for key, model in (("num_key_value_heads", "its attention has one key/value head, shared by every query head"),
                       ("n_shared_experts", "its MoE block has one shared expert")):
        if value(raw, key) != 1:
            raise UserError(f"config.json {key}={raw[key]} is not supported: transformers' DeepSeek-V4 builds the "
                            f"model with 1 ({model})")
    if not value(raw, "norm_topk_prob"):
        raise UserError("config.json norm_topk_prob=false is not supported: DeepSeek-V4's routers always renormalise "
                        "the chosen experts' weights")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise UserError(f"config.json {key}=true is not supported: DeepSeek-V4's layers have no biases")
    if value(raw, "hidden_act") != "silu":
        raise UserError(f"hidden_act '{raw['hidden_act']}' is not supported: DeepSeek-V4's experts are SwiGLU (silu)")
    if value(raw, "scoring_func") not in SCORING_FUNCS:
        raise UserError(f"scoring_func '{raw['scoring_func']}' is not supported: choose {', '.join(SCORING_FUNCS)}")
    if value(raw, "num_experts_per_tok") > value(raw, "n_routed_experts"):
        raise UserError(f"config.json num_experts_per_tok={value(raw, 'num_experts_per_tok')} is more than the "
                        f"{value(raw, 'n_routed_experts')} experts")
    heads, groups = value(raw, "num_attention_heads"), value(raw, "o_groups")
    if heads % groups:
        raise UserError(f"config.json o_groups={groups} does not divide the {heads} attention heads: the grouped "
                        "output projection takes whole heads")



FULL_RECOMPUTE_NEEDS_0_16 = ("full activation recomputation of DeepSeek-V4's layers needs megatron-core 0.16 here "
                             "(0.19's recompute drops the token ids its hash routers need): use AC=none")


def recompute_refused(arch, mode: str, megatron_core: tuple[int, ...]) -> str | None:
    return FULL_RECOMPUTE_NEEDS_0_16 if mode == "full" and megatron_core >= (0, 19) else None

def parse_config(raw: dict) -> Arch:
    check_supported(raw)
    layers, head_dim = value(raw, "num_hidden_layers"), value(raw, "head_dim")
    types = layer_types_of(raw, layers)
    partial = partial_rotary_factor_of(raw)
    rope_dim = int(head_dim * partial)
    if not 0 < rope_dim <= head_dim or rope_dim % 2:
        raise UserError(f"DeepSeek-V4's RoPE must rotate an even number of each head's {head_dim} dimensions: "
                        f"partial_rotary_factor {partial:g} gives {rope_dim}")
    main_theta, compress_theta, compress_yarn = ropes_of(raw)
    experts_width = value(raw, "moe_intermediate_size")
    return Arch(
        family="deepseek_v4", vocab_size=value(raw, "vocab_size"), hidden_size=value(raw, "hidden_size"),
        # no dense layers: every MLP is the MoE block; its shared expert has the experts' width
        ffn_hidden_size=experts_width, num_layers=layers, num_heads=value(raw, "num_attention_heads"),
        num_kv_heads=1, head_dim=head_dim, norm_eps=float(value(raw, "rms_norm_eps")), rope_theta=main_theta,
        rope_scaling=None, rotary_percent=rope_dim / head_dim,
        max_position_embeddings=value(raw, "max_position_embeddings"),
        tie_word_embeddings=bool(value(raw, "tie_word_embeddings")),
        num_experts=value(raw, "n_routed_experts"), moe_topk=value(raw, "num_experts_per_tok"),
        moe_ffn_hidden_size=experts_width, shared_expert_ffn_hidden_size=experts_width, norm_topk_prob=True,
        router_aux_loss_coef=float(value(raw, "router_aux_loss_coef")),
        layer_types=types, sliding_window=value(raw, "sliding_window"), attention_sinks=True,
        family_config=DeepseekV4Settings(
            mlp_layer_types=mlp_layer_types_of(raw, layers), hc_mult=value(raw, "hc_mult"),
            hc_sinkhorn_iters=value(raw, "hc_sinkhorn_iters"), hc_eps=float(value(raw, "hc_eps")),
            q_lora_rank=value(raw, "q_lora_rank"), qk_rope_head_dim=rope_dim, o_groups=value(raw, "o_groups"),
            o_lora_rank=value(raw, "o_lora_rank"), compress_rates=compress_rates_of(raw),
            compress_rope_theta=compress_theta, compress_rope_scaling=compress_yarn,
            index_n_heads=value(raw, "index_n_heads"), index_head_dim=value(raw, "index_head_dim"),
            index_topk=value(raw, "index_topk"), scoring_func=value(raw, "scoring_func"),
            routed_scaling_factor=float(value(raw, "routed_scaling_factor")),
            swiglu_limit=float(value(raw, "swiglu_limit")),
            num_nextn_predict_layers=value(raw, "num_nextn_predict_layers")),
        hf_config=raw,
    )


def parameter_count(arch: Arch) -> int:
    """The parameters of transformers' DeepseekV4ForCausalLM for this model (no MTP layers: transformers builds
    none; buffers such as ``tid2eid`` and the routers' score-correction bias are not parameters)."""
    s = arch.family_config
    h, heads, d, q = arch.hidden_size, arch.num_heads, arch.head_dim, s.q_lora_rank
    n, width, experts = s.hc_mult, arch.moe_ffn_hidden_size, arch.num_experts
    attention = (h * q + q + q * heads * d + h * d + d  # q_a_proj, q_a_norm, q_b_proj, kv_proj, kv_norm
                 + heads * d * s.o_lora_rank + s.o_groups * s.o_lora_rank * h + heads)  # o_a, o_b, sinks
    compressor = {
        SLIDING: 0,
        HCA: 2 * h * d + s.compress_rate(HCA) * d + d,  # kv_proj, gate_proj, position_bias, kv_norm
        CSA: (4 * h * d + s.compress_rate(CSA) * 2 * d + d  # the same, each row twice as wide (two series)
              # the lightning indexer: its own compressor over index_head_dim, its query projection, head weights
              + 4 * h * s.index_head_dim + s.compress_rate(CSA) * 2 * s.index_head_dim + s.index_head_dim
              + q * s.index_n_heads * s.index_head_dim + h * s.index_n_heads),
    }
    moe = experts * h + experts * 3 * h * width + 3 * h * width  # router, experts, the shared expert
    hyper = 2 * ((2 + n) * n * n * h + (2 + n) * n + 3)  # attn_hc and ffn_hc
    layers = sum(attention + compressor[t] + moe + hyper + 2 * h for t in arch.layer_types)
    embeddings = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
    return embeddings + layers + h + n * n * h + n + 1  # the final norm, hc_head


_ROPE_TABLE = Table(ROPE_FIELDS)
# The config.json fields this family reads (checked before it reads them: config_checks).
CONFIG_KEYS = {
    "vocab_size": Whole(1, MAX_VOCAB), "hidden_size": Whole(1, MAX_WIDTH), "moe_intermediate_size": Whole(1, MAX_WIDTH),
    "num_hidden_layers": Whole(1, MAX_LAYERS), "num_attention_heads": Whole(1, MAX_HEADS),
    "num_key_value_heads": Whole(1, MAX_HEADS), "head_dim": Whole(1, MAX_WIDTH), "q_lora_rank": Whole(1, MAX_WIDTH),
    "o_groups": Whole(1, MAX_HEADS), "o_lora_rank": Whole(1, MAX_WIDTH), "qk_rope_head_dim": Whole(1, MAX_WIDTH),
    "partial_rotary_factor": Real(0, 1.0), "max_position_embeddings": Whole(1, MAX_POSITIONS),
    "rms_norm_eps": Real(0, 1.0), "rope_theta": Real(0), "compress_rope_theta": Real(0),
    "rope_scaling": _ROPE_TABLE, "rope_parameters": Table({**ROPE_FIELDS, "main": _ROPE_TABLE, "compress": _ROPE_TABLE}),
    "sliding_window": Whole(1, MAX_POSITIONS), "layer_types": Names(MAX_LAYERS),
    "compress_ratios": WholeList(0, MAX_POSITIONS, MAX_LAYERS),
    "compress_rates": Table({CSA: Whole(1, MAX_POSITIONS), HCA: Whole(1, MAX_POSITIONS)}),
    "compress_rate_csa": Whole(1, MAX_POSITIONS), "compress_rate_hca": Whole(1, MAX_POSITIONS),
    "index_n_heads": Whole(1, MAX_HEADS), "index_head_dim": Whole(1, MAX_WIDTH), "index_topk": Whole(1, MAX_POSITIONS),
    "mlp_layer_types": Names(MAX_LAYERS), "num_hash_layers": Whole(0, MAX_LAYERS),
    "hc_mult": Whole(1, 64), "hc_sinkhorn_iters": Whole(1, 10_000), "hc_eps": Real(0, 1.0, closed=True),
    "n_routed_experts": Whole(1, MAX_EXPERTS), "num_experts_per_tok": Whole(1, MAX_EXPERTS),
    "n_shared_experts": Whole(0, MAX_EXPERTS), "scoring_func": Text(), "norm_topk_prob": Flag(),
    "routed_scaling_factor": Real(0), "swiglu_limit": Real(0), "router_aux_loss_coef": Real(0, closed=True),
    "num_nextn_predict_layers": Whole(0, MAX_LAYERS), "num_mtp_layers": Whole(0, MAX_LAYERS), "hidden_act": Text(), "tie_word_embeddings": Flag(),
    "attention_bias": Flag(), "mlp_bias": Flag(),
}

# A tiny DeepSeek-V4: four layers, one of each attention (sliding window of 8, CSA compressing every 4 tokens with an
# indexer keeping 4 entries, HCA every 8, so that short test sequences have compressed entries) and CSA again, the
# first two hash-routed; 4 heads of 32 over one key/value head, RoPE on the last 8 of each (YaRN on the compressed
# layers), the grouped output projection in 2 groups; 8 experts of 32 (top 2) and the shared one; 4 streams.
TINY_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 300, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "partial_rotary_factor": 0.25,
    "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "sliding_window": 8,
    "layer_types": [SLIDING, CSA, HCA, CSA], "compress_rates": {CSA: 4, HCA: 8},
    "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4,
    "mlp_layer_types": [HASH_MOE, HASH_MOE, MOE, MOE],
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                        "beta_fast": 32.0, "beta_slow": 1.0},
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "hidden_act": "silu", "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1,
    "torch_dtype": "float32",
}
