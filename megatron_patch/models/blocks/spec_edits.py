"""Small edits of megatron-core layer specs, for families whose layers need a module of their own.

megatron-core 0.16 writes a spec's entries as ``ModuleSpec``s, 0.19 as ``functools.partial``s of the
module class; ``submodules_of`` and ``with_submodules`` read and replace an entry's submodules in
either form.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
from megatron.core.tensor_parallel.layers import RowParallelLinear


def submodules_of(entry):
    return entry.keywords["submodules"] if isinstance(entry, functools.partial) else entry.submodules


def with_submodules(entry, **changes):
    """``entry`` (a ModuleSpec or a partial) with some of its submodules replaced."""
    new = dataclasses.replace(submodules_of(entry), **changes)
    if isinstance(entry, functools.partial):
        return functools.partial(entry.func, *entry.args, **{**entry.keywords, "submodules": new})
    return dataclasses.replace(entry, submodules=new)


class ExpertOutputLinear(RowParallelLinear):
    """An expert's ``linear_fc2`` whose output is its own tensor while training.

    megatron-core's MLP adds an expert's bias, scaled by its routing probability, into fc2's output in
    place; with one rank in the expert's tensor-parallel group that output is the reduction's input
    handed back as is, and autograd refuses the in-place add ("a view ... created inside a custom
    Function"). The copy costs one expert output per step; inference skips it.
    """

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        return (output.clone() if torch.is_grad_enabled() else output), bias


def with_module(entry, module: type, **params):
    """A spec entry (a ModuleSpec in megatron-core 0.16, a partial of the class or of a classmethod in 0.19) that
    builds ``module`` instead, with ``params`` added to what it is built with."""
    if isinstance(entry, functools.partial):
        func = getattr(module, entry.func.__name__) if inspect.ismethod(entry.func) else module
        return functools.partial(func, *entry.args, **{**entry.keywords, **params})
    return dataclasses.replace(entry, module=module, params={**entry.params, **params})


def with_params(entry, **params):
    """``entry`` (a ModuleSpec or a partial) built with ``params`` added (a layer's own settings)."""
    if isinstance(entry, functools.partial):
        return functools.partial(entry.func, *entry.args, **{**entry.keywords, **params})
    return dataclasses.replace(entry, params={**entry.params, **params})


def with_biased_experts(layer):
    """A local layer spec whose routed experts can carry biases while training (``ExpertOutputLinear``)."""
    moe = submodules_of(layer).mlp
    experts = submodules_of(moe).experts
    experts = with_submodules(experts, linear_fc2=ExpertOutputLinear)
    return with_submodules(layer, mlp=with_submodules(moe, experts=experts))
