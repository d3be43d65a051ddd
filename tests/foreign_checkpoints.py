"""Checkpoints in the layouts other tools write, made with megatron-core's own ``dist_checkpointing``
and ``torch.save``, never with this project's writers.

Each fixture starts from a tiny random HF model, loads it into megatron-core GPTModels on local gloo
ranks, and saves those models the way the tool does, so an export must give back the HF tensors
bit for bit. Which tool and version each layout follows:

- ``megatron_lm_torch_dist``: Megatron-LM ``megatron/training/checkpointing.py`` (main at d98e8a6,
  2026-08, with megatron-core 0.16), ``--ckpt-format torch_dist``: ``iter_XXXXXXX/`` from one
  ``dist_checkpointing.save`` of {args, checkpoint_version 3.0, iteration, model (the GPTModel's
  sharded state dict: global keys, layers stacked), optimizer (``optimizer.state.<moment>.<param>``
  tensors), opt_param_scheduler, num_floating_point_operations_so_far, rng_state (a ShardedObject per
  rank)}; megatron's common state (common.pt up to megatron-core 0.16, the ``common_state`` object in the
  .distcp files from 0.19) then holds the args namespace; the TE spec adds one ``_extra_state`` object per
  linear layer and layer. The vocabulary is padded to a multiple of 128 x TP, as Megatron-LM pads it.
  The tracker holds the iteration number (no newline).
- ``megatron_lm_legacy``: the same tool with ``--ckpt-format torch``: one torch.save per model-
  parallel rank at ``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`` holding {args,
  checkpoint_version, iteration, model (``state_dict_for_save_checkpoint()``, local-spec names, or TE
  names with ``_extra_state`` entries), optimizer, opt_param_scheduler, rng_state, ...}; layers are
  numbered from 0 on every pipeline stage.
- ``pai_megatron_patch_legacy``: Pai-Megatron-Patch's ``toolkits/model_checkpoints_convertor``
  ``hf2mcore_*`` scripts (2024-2025): ``release/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` holding
  {args, checkpoint_version 3.0, iteration 0, model} with the ``_extra_state`` entries removed, the
  tracker saying ``release``, and the HF config.json and tokenizer files copied into the root.
- ``megatron_bridge_torch_dist``: NeMo / Megatron-Bridge 0.6 (megatron-core 0.19), as observed
  (docs' references): ``iter_0000000/`` with .metadata, *.distcp, metadata.json and run_config.yaml
  but no common.pt (the common state is inside the .distcp files), the tracker, and
  ``latest_train_state.pt``; no Megatron-LM args anywhere.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
from pathlib import Path

import torch

TE_NORM_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                 "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
TE_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def megatron_lm_args(arch, tp: int, pp: int, padded: int, ckpt_format: str, *, true_vocab: bool = True,
                     extra: dict | None = None) -> argparse.Namespace:
    """The fields of Megatron-LM's argument namespace that describe the model, as it saves them."""
    llama3 = (arch.rope_scaling or {}).get("rope_type") == "llama3"
    return argparse.Namespace(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads, group_query_attention=arch.num_kv_heads != arch.num_heads,
        num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim, max_position_embeddings=arch.max_position_embeddings,
        seq_length=64, position_embedding_type="rope", rotary_base=int(arch.rope_theta), use_rope_scaling=llama3,
        rotary_percent=arch.rotary_percent,
        rope_scaling_factor=(arch.rope_scaling or {}).get("factor", 8.0), normalization="RMSNorm",
        norm_epsilon=arch.norm_eps, swiglu=True, untie_embeddings_and_output_weights=not arch.tie_word_embeddings,
        add_bias_linear=False, add_qkv_bias=arch.qkv_bias, qk_layernorm=False, num_experts=arch.num_experts or None,
        moe_router_topk=arch.moe_topk or None, moe_ffn_hidden_size=arch.moe_ffn_hidden_size or None,
        moe_shared_expert_intermediate_size=arch.shared_expert_ffn_hidden_size or None,
        vocab_size=arch.vocab_size if true_vocab else None, padded_vocab_size=padded, make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=1,
        transformer_impl="local", ckpt_format=ckpt_format, bf16=False, fp16=False, params_dtype=torch.float32,
        tokenizer_type="HuggingFaceTokenizer", iteration=0, **(extra or {}))


def _fill_padding_rows(model, vocab: int, seed: int) -> None:
    """Megatron-LM's padding rows hold whatever initialisation gave them: never zeros to rely on."""
    from megatron.core import parallel_state as ps

    gen = torch.Generator().manual_seed(seed + ps.get_tensor_model_parallel_rank())
    for name, p in model.named_parameters():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            start = ps.get_tensor_model_parallel_rank() * p.shape[0]
            first_pad = max(0, vocab - start)
            if first_pad < p.shape[0]:
                with torch.no_grad():
                    p[first_pad:] = torch.randn(p.shape[0] - first_pad, p.shape[1], generator=gen)


def _built_model(hf_dir: str, layout, padded: int | None):
    """This rank's megatron-core GPTModel (local spec) holding the HF model's weights."""
    import dataclasses

    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.checkpoint.model_io import load_hf_weights
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.runtime import init_model_parallel

    init_model_parallel(layout)
    arch = dataclasses.replace(parse_arch(hf_dir), vocab_padded_to=padded)
    model = build_model(arch, layout, torch.float32, use_te=False)
    load_hf_weights(model, arch, layout, HFCheckpointReader(hf_dir))
    _fill_padding_rows(model, arch.vocab_size, seed=7)
    return model, arch


def _torch_dist_worker(hf_dir: str, folder: str, layout, padded: int, iteration: int, optimizer: bool,
                       te_extra_state: bool, with_args: bool) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    model, arch = _built_model(hf_dir, layout, padded)
    sharded = model.sharded_state_dict()
    tp, pp, dp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
    if te_extra_state:  # what TE's linear layers add: an (empty, without FP8) extra state per layer
        offset = pp * (arch.num_layers // layout.pp)
        for local in range(arch.num_layers // layout.pp):
            for module in TE_LINEARS:
                key = f"decoder.layers.{module}._extra_state"
                sharded[f"decoder.layers.{local}.{module}._extra_state"] = ShardedObject(
                    key, io.BytesIO(), (arch.num_layers,), (offset + local,), replica_id=(0, tp, dp))
    state = {"model": sharded, "checkpoint_version": 3.0, "iteration": iteration,
             "num_floating_point_operations_so_far": 0,
             "rng_state": ShardedObject("rng_state", [{"random_rng_state": (3, (0,) * 5, None),
                                                       "torch_rng_state": torch.get_rng_state()}],
                                        (layout.pp, layout.tp), (pp, tp), replica_id=dp)}
    if with_args:
        state["args"] = megatron_lm_args(arch, layout.tp, layout.pp, padded, "torch_dist")
    if optimizer:
        moments = {}
        for name, entry in sharded.items():
            if hasattr(entry, "data") and isinstance(entry.data, torch.Tensor) and not name.endswith("_extra_state"):
                for kind in ("exp_avg", "exp_avg_sq"):
                    moments[f"{kind}.{name}"] = make_sharded_optimizer_tensor(
                        entry, torch.zeros_like(entry.data), prefix=f"optimizer.state.{kind}")
        state["optimizer"] = {"state": moments, "param_groups": [{"lr": 1e-4, "params": []}]}
        state["opt_param_scheduler"] = {"max_lr": 1e-4, "num_steps": iteration * 8}
    dist_checkpointing.save(state, folder)
    dist.barrier()


def megatron_lm_torch_dist(hf_dir, root, *, tp: int = 2, iteration: int = 20, padded: int | None = None,
                           optimizer: bool = True, te: bool = True, args: bool = True) -> Path:
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.runtime import ParallelLayout
    from megatron_patch.runtime.launch import run_local

    root = Path(root)
    arch = parse_arch(hf_dir)
    padded = padded or -(-arch.vocab_size // (128 * tp)) * 128 * tp
    folder = root / f"iter_{iteration:07d}"
    folder.mkdir(parents=True)
    run_local(_torch_dist_worker, tp, str(hf_dir), str(folder), ParallelLayout(tp=tp), padded, iteration, optimizer,
              te, args)
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root


def megatron_bridge_torch_dist(hf_dir, root, *, tp: int = 2, padded: int | None = None) -> Path:
    """Megatron-Bridge's layout: the same ``dist_checkpointing.save`` output as Megatron-LM's but without
    Megatron-LM's args, its common state inside the .distcp files (megatron-core 0.19: no common.pt; the
    common.pt megatron-core 0.16 writes is removed), run_config.yaml beside the weights,
    ``latest_train_state.pt`` beside the tracker."""
    root = Path(root)
    megatron_lm_torch_dist(hf_dir, root, tp=tp, iteration=0, padded=padded, args=False)
    (root / "iter_0000000" / "common.pt").unlink(missing_ok=True)
    (root / "iter_0000000" / "run_config.yaml").write_text(
        "model:\n  _target_: megatron.bridge.models.llama.Llama3ModelProvider\n")
    torch.save({"step": 0}, root / "latest_train_state.pt")
    return root


def _legacy_worker(hf_dir: str, folder: str, layout, padded: int, te_names: bool, payload: dict) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    model, arch = _built_model(hf_dir, layout, padded)
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    weights = model.state_dict_for_save_checkpoint()
    if te_names:  # the TE spec's names: norms fused into the next linear layer, an _extra_state per module
        renamed = {}
        for name, value in weights.items():
            for local, te in TE_NORM_NAMES.items():
                if name.endswith("." + local):
                    name = name[: -len(local)] + te
            renamed[name] = value
        for name in list(renamed):
            if name.endswith(".weight") and any(m in name for m in TE_LINEARS) and "layer_norm" not in name:
                renamed[name[: -len("weight")] + "_extra_state"] = io.BytesIO()
        weights = renamed
    else:
        weights = {k: v for k, v in weights.items() if not k.endswith("_extra_state")}
    name = f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if layout.pp > 1 else "")
    path = Path(folder) / name / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"model": weights, **payload}
    if "args" in payload:
        state["args"] = megatron_lm_args(arch, layout.tp, layout.pp, padded, "torch", extra=payload["args"])
    if payload.get("optimizer"):
        state["optimizer"] = {"optimizer": {"state": {i: {"exp_avg": torch.zeros_like(v)}
                                                      for i, v in enumerate(weights.values())
                                                      if isinstance(v, torch.Tensor)}},
                              "param_groups": [{"lr": 1e-4}]}
    torch.save(state, path)
    dist.barrier()


def megatron_lm_legacy(hf_dir, root, *, tp: int = 1, pp: int = 2, iteration: int = 10, te_names: bool = False,
                       padded: int | None = None) -> Path:
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.runtime import ParallelLayout
    from megatron_patch.runtime.launch import run_local

    root = Path(root)
    arch = parse_arch(hf_dir)
    padded = padded or -(-arch.vocab_size // (128 * tp)) * 128 * tp
    folder = root / f"iter_{iteration:07d}"
    payload = {"args": {}, "checkpoint_version": 3.0, "iteration": iteration, "optimizer": True,
               "opt_param_scheduler": {"num_steps": iteration * 8}, "num_floating_point_operations_so_far": 0,
               "rng_state": [{"random_rng_state": (3, (0,) * 5, None), "np_rng_state": None,
                              "torch_rng_state": torch.get_rng_state()}]}
    run_local(_legacy_worker, tp * pp, str(hf_dir), str(folder), ParallelLayout(tp=tp, pp=pp), padded, te_names, payload)
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root


def pai_megatron_patch_legacy(hf_dir, root, *, tp: int = 2) -> Path:
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.runtime import ParallelLayout
    from megatron_patch.runtime.launch import run_local

    root = Path(root)
    arch = parse_arch(hf_dir)
    padded = -(-arch.vocab_size // (128 * tp)) * 128 * tp
    payload = {"args": {"patch_tokenizer_type": "LLamaTokenizer"}, "checkpoint_version": 3.0, "iteration": 0}
    run_local(_legacy_worker, tp, str(hf_dir), str(root / "release"), ParallelLayout(tp=tp), padded, False, payload)
    (root / "latest_checkpointed_iteration.txt").write_text("release")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (Path(hf_dir) / name).exists():
            shutil.copy(Path(hf_dir) / name, root / name)
    return root


def hf_tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def read_config(folder) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())
