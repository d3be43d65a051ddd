"""MiniMax-M2 (and its point releases): GQA with whole-width q/k norms, partial RoPE, sigmoid-routed experts."""

from megatron_patch.models.description.family import HFModules, ModelFamily, TestLayouts
from megatron_patch.models.description.registry import register
from megatron_patch.models.minimax_m2.config import (
    CONFIG_KEYS, TINY_CONFIG, layer_spec, parse_config, transformer_config_kwargs)
from megatron_patch.models.minimax_m2.mapping import weight_rules
from megatron_patch.models.minimax_m2.presets import PRESETS
from megatron_patch.runtime.distributed import ParallelLayout as L

FAMILY = register(ModelFamily(
    name="minimax_m2", summary="MiniMax-M2 / M2.1 / M2.5: GQA with q/k RMSNorms over all heads (summed over TP), "
                               "partial RoPE (rotary_dim), sigmoid routing with a correction bias, no shared "
                               "expert; FP8 hub weights",
    hf_model_types=("minimax_m2",), hf_architectures=("MiniMaxM2ForCausalLM",),
    parse_config=parse_config, config_keys=CONFIG_KEYS,
    weight_rules=weight_rules, tiny_config=TINY_CONFIG, presets=PRESETS,
    transformer_config_kwargs=transformer_config_kwargs, launcher_parallel_args=("ETP", "EP"),
    # transformers 5 names the hub's block_sparse_moe "mlp"
    hf_modules=HFModules(mlp=("mlp", "block_sparse_moe"), router=("mlp.gate", "block_sparse_moe.gate")),
    layer_spec=layer_spec,
    skeleton_from_megatron_core="its whole-width q/k norms are modules of its own",
    test_layouts=TestLayouts(
        # TP=2 splits the q/k norms' heads: its logits equal TP=1's only through the norms' all-reduce
        parity=(L(), L(tp=2, ep=2), L(pp=2)),
        round_trips=(("legacy", L(tp=2, pp=2, ep=2), "fp32"), ("torch_dist", L(tp=2, ep=2, etp=1), "bf16"))),
))
