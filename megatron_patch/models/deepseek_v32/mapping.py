"""DeepSeek-V3.2 / GLM-5 HF <-> MCore weight table: DeepSeek-V3's (``deepseek_v3/mapping.py``) with each layer's
indexer, whose four tensors are whole on every TP rank (megatron-core's DSA indexer keeps them so), MTP
layers' included."""

from megatron_patch.models.blocks.decoder import HF_LAYER, MC_LAYER, dense_mlp_rules, embedding_and_head_rules
from megatron_patch.models.blocks.mtp import mtp_rules
from megatron_patch.models.deepseek_v3.mapping import attention_rules, deepseek_moe_rules
from megatron_patch.models.deepseek_v32.config import v3_view
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.mapping import REPLICATED, LoraSite, Rule

# (MCore, HF, whether it is a linear layer's weight: LoRA's "indexer" target, off unless MP_LORA_TARGETS names it)
INDEXER_TENSORS = (("linear_wq_b.weight", "wq_b.weight", True), ("linear_wk.weight", "wk.weight", True),
                   ("k_norm.weight", "k_norm.weight", False), ("k_norm.bias", "k_norm.bias", False),
                   ("linear_weights_proj.weight", "weights_proj.weight", True))


def indexer_rules() -> list[Rule]:
    mc, hf = f"{MC_LAYER}.self_attention.core_attention.indexer", f"{HF_LAYER}.self_attn.indexer"
    return [Rule(f"{mc}.{m}", f"{hf}.{h}", REPLICATED, lora=LoraSite("indexer") if linear else None)
            for m, h, linear in INDEXER_TENSORS]


def weight_rules(arch: Arch) -> list[Rule]:
    v3 = v3_view(arch)
    layer = attention_rules(v3) + indexer_rules() + deepseek_moe_rules(v3)
    return (embedding_and_head_rules() + layer + (dense_mlp_rules() if arch.dense_layers else [])
            + (mtp_rules(layer) if arch.mtp_layers else []))
