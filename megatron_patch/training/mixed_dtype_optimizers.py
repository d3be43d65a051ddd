"""megatron-core's optimizers over a model of mixed dtypes: the float32 parameters a family keeps in a bf16/fp16
model (DeepSeek-V4's hyper-connections, sinks and norms; ``models/blocks/precision.py``).

Both optimizers train such a model as it is (a float32 parameter is its own master copy), and both failed at the
first checkpoint save, in megatron-core 0.16 and 0.19 alike:
- the distributed optimizer puts each group's float32 shards before its 16-bit ones in the inner optimizer, while
  its map from a model parameter to its place there (``model_param_group_index_map``) keeps the grad buffers'
  order: the state of one parameter was taken for another's (a size mismatch, or worse where sizes agree);
- the other (``Float16OptimizerWithFloat16Params``) numbers only its 16-bit parameters when it pairs the inner
  optimizer's state with the model's tensors, which the inner optimizer numbers all together.
``mend_mixed_dtypes`` mends both in place once the optimizer is built. A model of one dtype is left as it is (its
maps are already these).
"""

from __future__ import annotations

import types


def mend_mixed_dtypes(optimizer) -> int:
    """Mends each of ``optimizer``'s (a megatron-core optimizer, chained or not) sub-optimizers that holds float32
    parameters beside 16-bit ones; returns how many it mended."""
    # megatron-core: in a rank, after the compatibility layer has patched torch (runtime/cpu_compat.py)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    mended = 0
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(sub, DistributedOptimizer) and any(sub.model_fp32_groups) and any(sub.model_float16_groups):
            _index_as_the_inner_optimizer_orders(sub)
            mended += 1
        elif isinstance(sub, Float16OptimizerWithFloat16Params) and any(sub.fp32_from_fp32_groups):
            sub.sharded_state_dict = types.MethodType(_float16_sharded_state_dict, sub)
            sub.load_state_dict = types.MethodType(_float16_load_state_dict, sub)
            mended += 1
    return mended


def _index_as_the_inner_optimizer_orders(optimizer) -> None:
    # _build_model_and_main_param_groups gives group g the params [*float32 shards, *16-bit shards' main copies]
    for group, (fp32, float16) in enumerate(zip(optimizer.model_fp32_groups, optimizer.model_float16_groups)):
        for order, model_param in enumerate([*fp32, *float16]):
            optimizer.model_param_group_index_map[model_param] = (group, order)


def _float16_sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
    """megatron-core's ``Float16OptimizerWithFloat16Params.sharded_state_dict`` with the inner optimizer's
    parameters numbered as it numbers them: every parameter of every group, a 16-bit one by its master copy. The
    keys and the layout of what is saved are megatron-core's."""
    # megatron-core: in a rank, after the compatibility layer has patched torch (runtime/cpu_compat.py)
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
        optim_state_to_sharding_state,
    )

    if is_loading:
        self.init_state_fn(self.optimizer, self.config)
    state_dict = self.state_dict()
    model_param_of = {id(main): model
                      for models, mains in zip(self.float16_groups, self.fp32_from_float16_groups)
                      for model, main in zip(models, mains)}
    groups = self.optimizer.param_groups
    id_to_sharded_param_map = get_param_id_to_sharded_param_map(
        model_sharded_state_dict, [model_param_of.get(id(p), p) for group in groups for p in group["params"]])
    # each group's master copies, in the order of fp32_from_float16_groups (load_state_dict's), by their own ids;
    # by group index, a group of float32 parameters alone left out: megatron-core's checkpoint merges lists by
    # position, and the empty list of such a group took the place of the one before it at load
    masters = {index: [make_sharded_optimizer_tensor(id_to_sharded_param_map[param_id], param,
                                                     prefix="optimizer.state.fp32_param")
                       for param_id, param in zip(state_group["params"], group["params"]) if id(param) in model_param_of]
               for index, (group, state_group) in enumerate(zip(groups, state_dict["optimizer"]["param_groups"]))}
    state_dict["fp32_from_fp16_params"] = {index: tensors for index, tensors in masters.items() if tensors}
    step = self._extract_common_per_param_step(state_dict["optimizer"])
    optim_state_to_sharding_state(state_dict["optimizer"], id_to_sharded_param_map, exclude_keys="step")
    if step:
        state_dict["optimizer"]["state"]["common_step"] = step
    return state_dict


def _float16_load_state_dict(self, state_dict):
    """megatron-core's ``load_state_dict``, given the master copies in its list of groups (above: by group index)."""
    saved = state_dict.get("fp32_from_fp16_params")
    if isinstance(saved, dict):
        state_dict = {**state_dict, "fp32_from_fp16_params": [saved.get(index, [])
                                                              for index in range(len(self.fp32_from_float16_groups))]}
    return type(self).load_state_dict(self, state_dict)
