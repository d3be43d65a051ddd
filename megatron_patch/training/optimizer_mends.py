"""Mends of megatron-core's optimizers (0.16 and 0.19 alike), applied once the optimizer is built, so that what
they train they also save and resume. Each leaves an optimizer that does not need it as it is.

A model of mixed dtypes: the float32 parameters a family keeps in a bf16/fp16 model (DeepSeek-V4's
hyper-connections, sinks and norms; ``models/blocks/precision.py``). Both optimizers train it as it is (a float32
parameter is its own master copy), and both failed at the first checkpoint save:
- the distributed optimizer puts each group's float32 shards before its 16-bit ones in the inner optimizer, while
  its map from a model parameter to its place there (``model_param_group_index_map``) keeps the grad buffers'
  order: the state of one parameter was taken for another's (a size mismatch, or worse where sizes agree);
- the other (``Float16OptimizerWithFloat16Params``) numbers only its 16-bit parameters when it pairs the inner
  optimizer's state with the model's tensors, which the inner optimizer numbers all together; and a group of
  float32 parameters alone saved an empty list of master copies, which megatron-core's merge by position put in
  the place of another group's at load. It saves them by group index instead.

An optimizer with no parameters on this rank: megatron-core gives every rank the same parameter groups, so an MoE
model's pipeline stage without an expert layer holds an experts' optimizer of empty groups (EP > 1). With torch's
Adam (no transformer-engine) it has no step to save: the distributed optimizer failed at the first save, and the
others saved no step, which global rank 0 (such a stage) writes for every rank, so the ranks that hold experts
failed at the resume (and rank 0's empty lists of master copies stood in the others' place, as above). Such an
optimizer now saves the step of the optimizers beside it, which step together, and no master copies, as a rank
whose copies are all sharded leaves none in the state rank 0 writes: the checkpoint resumes at a layout whose
stages all hold experts, and the other way round.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist


def mend_optimizers(optimizer) -> list[str]:
    """Mends ``optimizer`` (a megatron-core optimizer, chained or not) in place; returns what it mended."""
    # megatron-core: in a rank, after the compatibility layer has patched torch (runtime/cpu_compat.py)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    subs = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    # The 16-bit optimizer's master copies are saved by group index where any rank's copy of it holds float32
    # parameters beside 16-bit ones (a family's choice, so at every layout of the model): rank 0 writes the part of
    # the state that is not sharded for every rank, and its empty list of a group would stand in another's place at
    # load (megatron-core merges lists by position). Decided by all ranks together: one checkpoint, one layout.
    by_group_index = _on_any_rank([isinstance(sub, Float16OptimizerWithFloat16Params) and any(sub.fp32_from_fp32_groups)
                                   and any(sub.float16_groups) for sub in subs])
    mended = []
    for index, (sub, by_index) in enumerate(zip(subs, by_group_index)):
        if isinstance(sub, DistributedOptimizer) and any(sub.model_fp32_groups) and any(sub.model_float16_groups):
            _index_as_the_inner_optimizer_orders(sub)
            mended.append(f"optimizer {index}: mixed dtypes")
        if by_index:
            sub.sharded_state_dict = types.MethodType(_float16_sharded_state_dict, sub)
            sub.load_state_dict = types.MethodType(_float16_load_state_dict, sub)
            mended.append(f"optimizer {index}: master copies by group")
        elif isinstance(sub, Float16OptimizerWithFloat16Params) and not _holds_parameters(sub):
            _without_master_copies(sub)
            mended.append(f"optimizer {index}: no master copies on this rank")
        siblings = [other for other in subs if other is not sub and _holds_parameters(other)]
        if _torch_adam(sub) and not _holds_parameters(sub) and siblings:
            _save_the_step_of(sub, siblings[0])
            mended.append(f"optimizer {index}: no parameters on this rank")
    return mended


def _on_any_rank(flags: list[bool]) -> list[bool]:
    """Each flag, true where it is true on any rank of the job (every rank holds as many sub-optimizers)."""
    if not flags or not dist.is_initialized():
        return flags
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    counts = torch.tensor([int(flag) for flag in flags], device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    return [bool(count) for count in counts.tolist()]


def _torch_adam(optimizer) -> bool:
    """Whether ``optimizer``'s inner optimizer is torch's Adam, whose step is per parameter (the chunked optimizer's
    own Adam, training/offload/, counts its steps itself)."""
    return isinstance(getattr(optimizer, "optimizer", None), torch.optim.Adam | torch.optim.AdamW)


def _holds_parameters(optimizer) -> bool:
    inner = getattr(optimizer, "optimizer", None)
    return inner is not None and any(group["params"] for group in inner.param_groups)


def _torch_step(optimizer):
    """The step of torch's Adam inside ``optimizer`` (one for all its parameters; None before the first)."""
    return next((state["step"] for state in optimizer.optimizer.state.values() if "step" in state), None)


def _save_the_step_of(optimizer, sibling) -> None:
    # megatron-core: in a rank, after the compatibility layer has patched torch (runtime/cpu_compat.py)
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer

    if isinstance(optimizer, DistributedOptimizer):
        if HAVE_APEX_OR_TE:  # the fused optimizers keep the step in the groups, which megatron-core aligns itself
            return

        def state_dict(self):
            # DistributedOptimizer.state_dict's torch path, which asserts one step among its (here no) parameters
            inner = self.optimizer.state_dict()
            step = _torch_step(sibling)
            # a number, as megatron-core's own; 0 where the siblings have none yet (a load's template, replaced)
            step = step.item() if step is not None else 0.0
            groups = [{**{k: v for k, v in group.items() if k != "params"}, "step": step}
                      for group in inner["param_groups"]]
            saved = {"optimizer": {**{k: v for k, v in inner.items() if k != "state"}, "param_groups": groups}}
            if self.grad_scaler:
                saved["grad_scaler"] = self.grad_scaler.state_dict()
            return saved

        optimizer.state_dict = types.MethodType(state_dict, optimizer)
        return
    original = optimizer.sharded_state_dict

    def sharded_state_dict(model_sharded_state_dict, is_loading: bool = False, metadata=None):
        saved = original(model_sharded_state_dict, is_loading, metadata)
        # FP32Optimizer's is torch's state dict itself, Float16OptimizerWithFloat16Params' holds it as "optimizer"
        state = (saved["optimizer"] if "optimizer" in saved else saved)["state"]
        step = _torch_step(sibling)
        if "common_step" not in state and step is not None:
            state["common_step"] = step
        return saved

    optimizer.sharded_state_dict = sharded_state_dict


def _without_master_copies(optimizer) -> None:
    """A 16-bit optimizer with no parameters on this rank saves no master copies and reads none: its empty lists,
    which rank 0 writes for every rank, took the place of the copies of the ranks that hold parameters. A rank whose
    copies are all sharded leaves none in that common state either, so the checkpoint reads the same whichever
    pipeline split wrote it."""
    original = optimizer.sharded_state_dict

    def sharded_state_dict(model_sharded_state_dict, is_loading: bool = False, metadata=None):
        saved = original(model_sharded_state_dict, is_loading, metadata)
        if isinstance(saved.get("fp32_from_fp16_params"), list) and not any(saved["fp32_from_fp16_params"]):
            del saved["fp32_from_fp16_params"]
        return saved

    optimizer.sharded_state_dict = sharded_state_dict
    optimizer.load_state_dict = types.MethodType(_float16_load_state_dict, optimizer)


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
    """megatron-core's ``load_state_dict``, given the master copies in its list of groups (above: by group index;
    none where this rank holds no parameters)."""
    saved = state_dict.get("fp32_from_fp16_params", state_dict.get("fp32_from_fp16"))
    if saved is None and not _holds_parameters(self):
        state_dict = {**state_dict, "fp32_from_fp16_params": [[] for _ in self.fp32_from_float16_groups]}
    elif isinstance(saved, dict):
        state_dict = {**state_dict, "fp32_from_fp16_params": [saved.get(index, [])
                                                              for index in range(len(self.fp32_from_float16_groups))]}
    return type(self).load_state_dict(self, state_dict)
