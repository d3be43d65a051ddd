"""DeepSeek-V4 HF <-> MCore weight table, by the names on disk: DeepSeek's own (``attn.wq_a``,
``attn.compressor.wkv``, ``ffn.gate.tid2eid``, ``hc_attn_fn``, ...), which transformers 5.24 renames as it loads
them and writes back as it saves (its ``conversion_mapping``, "deepseek_v4"), under ``model.`` with the output
layer as ``head.weight``. The attention's rows come from ``weights_of`` (the layer types' own weights:
the compressor on CSA and HCA layers, the indexer on CSA ones), the hash tables (``tid2eid``) on ``hash_moe``
layers and the expert bias on ``moe`` ones.

LoRA: peft names adapters by the modules transformers loads (``self_attn.q_a_proj``), so the family declares
``LOADED_NAMES``, the table's names as loaded. The sites are the attention's projections and the routed and shared
experts, as DeepSeek-V3's. The grouped output projection ``o_a_proj`` takes none: peft wraps it as a plain linear
whose adapter adds all groups' rows to each group's output, which fails in peft's forward, so no peft adapter on it
has a meaning to convert (``LORA_REFUSED``).

The float32 parameters (sinks, position biases, norms) keep the dtype their file holds (``kept_as_stored``)."""

import dataclasses

from megatron_patch.models.deepseek_v4.settings import CSA, HCA, SLIDING, DeepseekV4Settings, settings
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.mapping import (
    AS_STORED, COLUMN, FLOAT_AS_STORED, GATE_UP, REPLICATED, ROW, VOCAB, LoraSite, Rule, Scope)

MC = "decoder.layers.{layer}"
HF = "model.layers.{layer}"
HC_PARTS = ("fn", "base", "scale")
# transformers writes the key/value norms back as the hub's ``norm`` (its ``.norm.`` -> ``.kv_norm.`` renaming)
ON_DISK = {"kv_norm.weight": "norm.weight"}
# checkpoints spell a norm before a linear by the transformer-engine name of the fused pair (models/mapping/naming.py):
# the query latent's norm precedes linear_q_up_proj, as in multi-latent attention
CHECKPOINT_NAMES = {"q_layernorm.weight": "linear_q_up_proj.layer_norm_weight"}
# the hash tables are integers: kept in the integer dtype their file holds (int64 as transformers writes them, int32
# in ports of the hub's checkpoint), whatever the checkpoint's float dtype, and written back in it; the model's buffer
# is int32 and takes them by value
TID2EID_DTYPE = AS_STORED
# LoRA on the attention: the query's down and up projections and the key/value projection are its input side
# ("qkv"), o_b its output ("proj"); the grouped o_a has none (module doc)
ATTENTION_LORA = {"linear_q_down_proj.weight": LoraSite("qkv"), "linear_q_up_proj.weight": LoraSite("qkv"),
                  "linear_kv_proj.weight": LoraSite("qkv"), "linear_proj.weight": LoraSite("proj")}
# peft's name of a module -> why an adapter on it is refused (ModelFamily.lora_refused)
LORA_REFUSED = {"self_attn.o_a_proj": "DeepSeek-V4's grouped output projection, on which peft's LoRA is one linear over "
                                     "every group (its forward fails), takes no LoRA: adapt o_b_proj (target proj)"}


# The attention's weights: (this module's name, transformers' name under ``self_attn``, the hub's name under
# ``attn``, how TP splits it). The compressor's rows are CSA's and HCA's, the indexer's CSA's only.
WEIGHTS = (
    ("linear_q_down_proj.weight", "q_a_proj.weight", "wq_a.weight", REPLICATED),
    ("q_layernorm.weight", "q_a_norm.weight", "q_norm.weight", REPLICATED),
    ("linear_q_up_proj.weight", "q_b_proj.weight", "wq_b.weight", COLUMN),
    ("linear_kv_proj.weight", "kv_proj.weight", "wkv.weight", REPLICATED),
    ("kv_layernorm.weight", "kv_norm.weight", "kv_norm.weight", REPLICATED),
    ("linear_o_group_proj.weight", "o_a_proj.weight", "wo_a.weight", COLUMN),
    ("linear_proj.weight", "o_b_proj.weight", "wo_b.weight", ROW),
    ("sinks", "sinks", "attn_sink", COLUMN),
)
COMPRESSOR_WEIGHTS = (
    ("compressor.linear_kv.weight", "compressor.kv_proj.weight", "compressor.wkv.weight", REPLICATED),
    ("compressor.linear_gate.weight", "compressor.gate_proj.weight", "compressor.wgate.weight", REPLICATED),
    ("compressor.position_bias", "compressor.position_bias", "compressor.ape", REPLICATED),
    ("compressor.kv_layernorm.weight", "compressor.kv_norm.weight", "compressor.norm.weight", REPLICATED),
)
INDEXER_WEIGHTS = (
    ("indexer.compressor.linear_kv.weight", "compressor.indexer.kv_proj.weight", "indexer.compressor.wkv.weight",
     REPLICATED),
    ("indexer.compressor.linear_gate.weight", "compressor.indexer.gate_proj.weight",
     "indexer.compressor.wgate.weight", REPLICATED),
    ("indexer.compressor.position_bias", "compressor.indexer.position_bias", "indexer.compressor.ape", REPLICATED),
    ("indexer.compressor.kv_layernorm.weight", "compressor.indexer.kv_norm.weight", "indexer.compressor.norm.weight",
     REPLICATED),
    ("indexer.linear_q_up_proj.weight", "compressor.indexer.q_b_proj.weight", "indexer.wq_b.weight", REPLICATED),
    ("indexer.linear_weights_proj.weight", "compressor.indexer.scorer.weights_proj.weight",
     "indexer.weights_proj.weight", REPLICATED),
)


def weights_of(layer_type: str) -> tuple:
    """The ``WEIGHTS`` rows of a layer type's attention."""
    return WEIGHTS + (COMPRESSOR_WEIGHTS if layer_type != SLIDING else ()) + (INDEXER_WEIGHTS if layer_type == CSA else ())


def attention_rules() -> list[Rule]:
    def rules(rows, **only):
        return [Rule(f"{MC}.self_attention.{CHECKPOINT_NAMES.get(mine, mine)}", f"{HF}.attn.{ON_DISK.get(hub, hub)}",
                     split, lora=ATTENTION_LORA.get(mine), **only)
                for mine, _, hub, split in rows]
    return (rules(WEIGHTS) + rules(COMPRESSOR_WEIGHTS, attention=CSA) + rules(COMPRESSOR_WEIGHTS, attention=HCA)
            + rules(INDEXER_WEIGHTS, attention=CSA))


def hyper_connection_rules() -> list[Rule]:
    return [Rule(f"{MC}.{norm}.weight", f"{HF}.{hub}.weight", REPLICATED)
            for norm, hub in (("input_layernorm", "attn_norm"), ("pre_mlp_layernorm", "ffn_norm"))] + [
        Rule(f"{MC}.{site}_hc.{part}", f"{HF}.hc_{site}_{part}", REPLICATED, dtype="float32")
        for site in ("attn", "ffn") for part in HC_PARTS]


def moe_rules(arch: Arch) -> list[Rule]:
    own = settings(arch)
    hashed = frozenset(i for i in range(arch.num_layers) if own.is_hash_layer(i))
    mc, ffn, expert = f"{MC}.mlp", f"{HF}.ffn", f"{HF}.ffn.experts.{{expert}}"
    shared = f"{ffn}.shared_experts"
    return [
        Rule(f"{mc}.router.weight", f"{ffn}.gate.weight", REPLICATED),
        Rule(f"{mc}.router.tid2eid", f"{ffn}.gate.tid2eid", REPLICATED, only=hashed, dtype=TID2EID_DTYPE),
        Rule(f"{mc}.router.expert_bias", f"{ffn}.gate.bias", REPLICATED,
             only=frozenset(range(arch.num_layers)) - hashed, dtype="float32"),
        # transformers stacks the routed experts as DeepSeek-V3's (gate_up_proj [E, 2I, H], down_proj [E, H, I]):
        # peft's target_parameters, named as loaded
        Rule(f"{mc}.experts.linear_fc1.weight{{expert}}", (f"{expert}.w1.weight", f"{expert}.w3.weight"), GATE_UP,
             Scope.EXPERT, lora=LoraSite("experts", hf_param=f"{HF}.mlp.experts.gate_up_proj")),
        Rule(f"{mc}.experts.linear_fc2.weight{{expert}}", f"{expert}.w2.weight", ROW, Scope.EXPERT,
             lora=LoraSite("experts", hf_param=f"{HF}.mlp.experts.down_proj")),
        Rule(f"{mc}.shared_experts.linear_fc1.weight", (f"{shared}.w1.weight", f"{shared}.w3.weight"), GATE_UP,
             lora=LoraSite("shared_experts")),
        Rule(f"{mc}.shared_experts.linear_fc2.weight", f"{shared}.w2.weight", ROW, lora=LoraSite("shared_experts")),
    ]


# A decoder layer's tensors that transformers loads under other names (its conversion_mapping, "deepseek_v4"),
# besides the attention's rows: (the table's name, the loaded one), relative to the layer
LAYER_LOADED = (
    ("attn_norm.weight", "input_layernorm.weight"), ("ffn_norm.weight", "post_attention_layernorm.weight"),
    *[(f"hc_{site}_{part}", f"{site}_hc.{part}") for site in ("attn", "ffn") for part in HC_PARTS],
    ("ffn.gate.weight", "mlp.gate.weight"), ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    *[(f"ffn.shared_experts.{hub}.weight", f"mlp.shared_experts.{loaded}.weight")
      for hub, loaded in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))],
)
# the table's names -> the loaded model's (ModelFamily.hf_loaded_prefixes): peft names adapters and
# modules_to_save by these; the routed experts' are their stacked parameters (the LoraSites' hf_param)
LOADED_NAMES = (
    ("head.weight", "lm_head.weight"),
    *[(f"{HF}.attn.{ON_DISK.get(hub, hub)}", f"{HF}.self_attn.{loaded}")
      for _, loaded, hub, _ in WEIGHTS + COMPRESSOR_WEIGHTS + INDEXER_WEIGHTS],
    *[(f"{HF}.{table}", f"{HF}.{loaded}") for table, loaded in LAYER_LOADED],
)


def weight_rules(arch: Arch) -> list[Rule]:
    return kept_as_stored(_weight_rules(arch))


def kept_as_stored(rules: list[Rule]) -> list[Rule]:
    """The float32 parameters' rules (sinks, position biases, norms: ``DeepseekV4Settings.float32_parameters``)
    keep the dtype their checkpoint holds: the model holds them in float32 whatever its dtype, and transformers
    saves them in float32 from a bf16 model, so ``--dtype bf16`` rounded them on the way in for nothing (the dsa
    audit); the hub's bf16 norms stay bf16, so either checkpoint round-trips byte for byte. The hyper-connection
    tensors keep their own fixed float32."""
    float32 = set(DeepseekV4Settings.float32_parameters)
    return [dataclasses.replace(rule, dtype=FLOAT_AS_STORED)
            if rule.dtype is None and float32 & set(rule.mcore.split(".")) else rule for rule in rules]


def _weight_rules(arch: Arch) -> list[Rule]:
    embedding, last = "model.embed_tokens.weight", Scope.LAST_STAGE
    return [
        Rule("embedding.word_embeddings.weight", embedding, VOCAB, Scope.FIRST_STAGE),
        *hyper_connection_rules(), *attention_rules(), *moe_rules(arch),
        *[Rule(f"decoder.final_layernorm.hc_head.{part}", f"model.hc_head.hc_{part}", REPLICATED, last,
               dtype="float32") for part in HC_PARTS],
        Rule("decoder.final_layernorm.weight", "model.norm.weight", REPLICATED, last),
        Rule("output_layer.weight", "head.weight", VOCAB, last, tied_to=embedding),
    ]
