"""``MP_COMPILE=true``: each decoder layer compiled with ``torch.compile`` (megatron-core's local spec and the
families' own layers, bf16 and fp8, CPU and GPU): the graph capture PAI-TorchAcc gets from XLA, done with what torch
ships.

What is compiled, decided per layer kind (layers of one structure: the layer's class and its submodules' names and
classes) at the first call of the first layer of that kind:

- **whole**, where the layer traces to one graph: its first call runs under ``error_on_graph_break``, and that
  first compilation is the one any compiled layer pays; the kind's other layers are compiled whole without a try;
- **apart**, where it does not: dynamo stops at the first break, nothing of the try has run, and the layer runs
  eagerly around its parts (attention, MLP, norms), each of which gets the same treatment at its own first call
  (an MLP whose token dispatch breaks: its router and experts apart, and so on down; a module holding no part that
  traces stays eager).

So a break costs one aborted trace per kind (no kernels are generated for it), at the first step, and nothing at
training start; the decision is made on the run's own layers (its TP, float8 GEMMs, attention). The training log and
the dry run (on the family's tiny model, ``family_compile_report``) say per kind what was compiled and the first
break's reason. Parts are compiled in place (the instance's ``forward``): classes, parameters and state dicts do not
change, so checkpoints are the same either way, and forward hooks run eagerly around the compiled code.

``MP_COMPILE_FUSIONS`` (``compiled_fusions.py``) stays the lighter option: it compiles only the memory-bound
pieces, in seconds. The two are not combined (validation refuses both at once): a compiled layer already covers
those pieces.
"""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch

from megatron_patch.errors import UserError
from megatron_patch.lazy import resolve_all
from megatron_patch.runtime.distributed import ParallelLayout, init_model_parallel
from megatron_patch.runtime.launch import run_local

# megatron-core (2.3 s to import after torch on 2 cores) is imported inside the functions that use it: the
# launcher's dry run imports this module before it knows whether it will build a model.

WHOLE, APART, EAGER = "whole", "apart", "eager"


@dataclass
class Plan:
    """What ``torch.compile`` does with the modules of one structure, decided at the first call of the first of
    them and shared by the others: ``decision`` None (not called yet), WHOLE, APART (``parts``: each part's plan)
    or EAGER (a module none of whose parts trace); ``reason``: the first break of the whole (APART, EAGER)."""

    decision: str | None = None
    reason: str | None = None
    parts: dict[str, "Plan"] = field(default_factory=dict)

    def leaves(self, path: str = ""):
        """(path, decision, reason) of each module that is compiled whole, left eager or not yet called."""
        if self.decision == APART:
            for name, part in self.parts.items():
                yield from part.leaves(f"{path}.{name}" if path else name)
        else:
            yield path, self.decision, self.reason

    def compiled(self) -> bool:
        return any(decision == WHOLE for _, decision, _ in self.leaves())

    def breaks(self, path: str = ""):
        """(path, first break) of each module below this one that was compiled apart."""
        for name, part in self.parts.items() if self.decision == APART else ():
            where = f"{path}.{name}" if path else name
            if part.decision == APART:
                yield where, part.reason
            yield from part.breaks(where)


@dataclass
class Kind:
    """The layers of one structure: a label, the layers (decoder layer numbers, or module paths) and their plan."""

    label: str
    layers: list
    plan: Plan
    told: bool = field(default=False, repr=False)  # on_decided called

    def lines(self) -> list[str]:
        """What was compiled, for the log and the dry run: one line, then the parts and breaks of an apart kind."""
        where = f"{self.label} [{_numbers(self.layers)}]"
        plan = self.plan
        if plan.decision is None:
            return [f"{where}: decided at its first call"]
        if plan.decision == WHOLE:
            return [f"{where}: whole (one graph)"]
        leaves = list(plan.leaves())
        by = {d: _collapse(p for p, decision, _ in leaves if decision == d) for d in (WHOLE, EAGER, None)}
        if plan.decision == EAGER or not by[WHOLE]:
            head = f"{where}: nothing compiles"
        else:
            head = f"{where}: apart, {len(by[WHOLE])} part(s) compiled"
        out = [head, f"  first break: {plan.reason}"]
        for path, reason in plan.breaks():
            if reason != plan.reason:  # the part the layer's own first break was in says nothing new
                out.append(f"  {_collapse([path])[0]} apart, first break: {reason}")
        if by[WHOLE]:
            out.append(f"  compiled: {', '.join(by[WHOLE])}")
        for path, decision, reason in leaves:
            if decision == EAGER:
                out.append(f"  eager: {_collapse([path])[0]}: {reason}")
        if by[None]:
            out.append(f"  not called yet: {', '.join(by[None])}")
        return _dedupe(out)


@dataclass
class Compilation:
    """What ``compile_layers`` set up: the layers it took and their kinds (each kind's plan fills in at its first
    call)."""

    kinds: list[Kind]
    plans: dict = field(default_factory=dict)  # structure -> Plan, for the parts of every kind
    backend: str | Callable | None = None  # torch.compile's (None: inductor)
    on_decided: Callable[[Kind], None] | None = None

    @property
    def layers(self) -> int:
        return sum(len(k.layers) for k in self.kinds)

    def lines(self) -> list[str]:
        return [line for kind in self.kinds for line in kind.lines()]

    def plan_of(self, module) -> Plan:
        return self.plans.setdefault(_structure(module), Plan())

    def report(self) -> dict:
        return {"layers": self.layers,
                "kinds": [{"label": k.label, "layers": k.layers, "decision": k.plan.decision,
                           "reason": k.plan.reason, "compiled": [p for p, d, _ in k.plan.leaves() if d == WHOLE]}
                          for k in self.kinds],
                "lines": self.lines()}


def compile_layers(models, backend: str | Callable | None = None, on_decided: Callable[[Kind], None] | None = None
                   ) -> Compilation:
    """Set every decoder layer of ``models`` (model chunks) to be compiled in place at its first call: whole, or
    its parts apart where the layer breaks the graph (the module's docstring). ``backend``: torch.compile's
    (None: inductor; "eager": dynamo's graphs run as they are, what the dry run needs to see the breaks);
    ``on_decided(kind)`` is called when a kind's first layer has run (the training log's lines). Refuses (one
    line) a model in which it finds no layer."""
    if not hasattr(torch._dynamo, "error_on_graph_break"):
        raise UserError(f"MP_COMPILE=true tries each kind of layer whole under torch._dynamo.error_on_graph_break, "
                        f"which torch {torch.__version__} lacks (2.9 and later have it): upgrade torch or drop "
                        "MP_COMPILE")
    _quiet_tp_group_warning()
    resolve_all()  # a lazy module's import on first use would break a layer's graph
    found = [(name, layer) for model in models for name, layer in _layers(model)]
    if not found:
        raise UserError("MP_COMPILE=true found no decoder layer to compile in this model (neither megatron-core's "
                        "TransformerLayer nor a layer in a TransformerBlock): drop MP_COMPILE")
    return compile_modules(found, backend, on_decided)


def compile_modules(found: list[tuple[str, torch.nn.Module]], backend: str | Callable | None = None,
                    on_decided: Callable[[Kind], None] | None = None) -> Compilation:
    """``compile_layers``'s engine, on (name, module) pairs: their kinds, each module set to decide at its kind's
    first call."""
    structures: dict = {}
    for name, layer in found:
        structures.setdefault(_structure(layer), []).append((name, layer))
    compilation = Compilation([], backend=backend, on_decided=on_decided)
    labels = _labels([members[0][1] for members in structures.values()])
    for (structure, members), label in zip(structures.items(), labels):
        kind = Kind(label, [_layer_id(name, layer) for name, layer in members], compilation.plan_of(members[0][1]))
        compilation.kinds.append(kind)
        for _, layer in members:
            _install(layer, compilation, kind)
    return compilation


def describe(compilation: Compilation) -> str:
    kinds = compilation.kinds
    return (f"torch.compile (MP_COMPILE): {compilation.layers} decoder layers of {len(kinds)} kind(s), each kind "
            "compiled whole where it traces to one graph, else its parts apart (decided at its first call)")


def _quiet_tp_group_warning() -> None:
    """megatron-core's ``get_tensor_model_parallel_group_if_none`` (0.16 and 0.19) warns on rank 0 at every call
    given no group: a ``warnings.warn`` with a category, which dynamo can neither trace nor reorder. Its
    RowParallelLinear hands its GEMM ``tp_group=None`` (and a family's code may call the region mappings without a
    group), so every megatron-core layer broke its graph there, on rank 0 alone. While dynamo traces, the default
    group is passed in: what the function returns, without the notice (eager calls still print it). Rebound in
    each loaded megatron-core module that imported the function by name."""
    from megatron.core import parallel_state, utils

    original = utils.get_tensor_model_parallel_group_if_none
    if hasattr(original, "__mp_original__"):
        return

    @functools.wraps(original)
    def group_if_none(tp_group, is_expert=False, check_initialized=True):
        if tp_group is None and torch.compiler.is_compiling() and parallel_state.is_initialized():
            group = (parallel_state.get_expert_tensor_parallel_group if is_expert
                     else parallel_state.get_tensor_model_parallel_group)
            tp_group = group(check_initialized=check_initialized)
        return original(tp_group, is_expert, check_initialized)

    group_if_none.__mp_original__ = original
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "get_tensor_model_parallel_group_if_none",
                                                        None) is original:
            module.get_tensor_model_parallel_group_if_none = group_if_none


def _layers(model):
    """(name, layer) of each decoder layer: a TransformerBlock's layers (megatron-core's or a family's own class)
    and any TransformerLayer outside a block (a multi-token-prediction layer's)."""
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_layer import TransformerLayer

    def walk(module, prefix):
        if isinstance(module, TransformerBlock):
            for i, layer in enumerate(module.layers):
                yield f"{prefix}layers.{i}", layer
        elif isinstance(module, TransformerLayer):
            yield prefix.rstrip("."), module
        else:
            for name, child in module.named_children():
                yield from walk(child, f"{prefix}{name}.")

    yield from walk(model, "")


def _structure(module) -> tuple:
    return (type(module), *((name, type(m)) for name, m in module.named_modules() if name))


def _layer_id(name: str, layer):
    number = getattr(layer, "layer_number", None)
    return number if isinstance(number, int) and re.search(r"(^|\.)decoder\.layers\.\d+$", name) else name


def _labels(layers) -> list[str]:
    """``Class(attention, MLP)`` of each kind's first layer; kinds that would share a label are told apart by the
    submodules (two levels down) that not all of them have."""
    def label(layer):
        parts = [type(getattr(layer, n)).__name__ for n in ("self_attention", "mlp") if hasattr(layer, n)]
        return f"{type(layer).__name__}({', '.join(parts)})" if parts else type(layer).__name__

    def shallow(layer):
        return {(n, type(m).__name__) for n, m in layer.named_modules() if n and n.count(".") <= 1
                and not re.search(r"\.\d+(\.|$)|^\d", n)}

    base = [label(layer) for layer in layers]
    out = []
    for i, layer in enumerate(layers):
        group = [other for j, other in enumerate(layers) if base[j] == base[i]]
        if len(group) == 1:
            out.append(base[i])
            continue
        common = set.intersection(*(shallow(g) for g in group))
        everywhere = set.intersection(*({n for n, _ in shallow(g)} for g in group))
        own = [f"{n}: {c}" if n in everywhere else n for n, c in sorted(shallow(layer) - common)]
        out.append(f"{base[i]} with {', '.join(own)}" if own else f"{base[i]}, plain")
    return out


def _numbers(ids: list) -> str:
    """[1, 2, 3, 5] -> '1-3, 5' (module paths as they are)."""
    numbers = sorted(i for i in ids if isinstance(i, int))
    runs = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    text = [f"{a}-{b}" if b > a else f"{a}" for a, b in runs] + [i for i in ids if not isinstance(i, int)]
    return ("layers " if numbers else "") + ", ".join(text)


def _collapse(paths) -> list[str]:
    """Module paths with their list indices as ``*`` (the experts of an MoE block are one entry), in order."""
    return _dedupe(re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", p) for p in paths)


def _dedupe(items) -> list:
    return list(dict.fromkeys(items))


def _parts(module):
    """(name, module) of the parts a module compiled apart hands on: its children, through module lists and dicts,
    but not megatron-core's placeholders (IdentityOp) or torch's Identity, which do nothing."""
    from megatron.core.transformer.identity_op import IdentityOp

    for name, child in module.named_children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            for sub, grandchild in _parts(child):
                yield f"{name}.{sub}", grandchild
        elif not isinstance(child, (IdentityOp, torch.nn.Identity)):
            yield name, child


def _install(module, compilation: Compilation, kind: Kind | None = None, plan: Plan | None = None) -> None:
    """``module`` as its plan says: compiled whole, its parts installed apart, eager, or (not decided yet) a first
    call that decides."""
    plan = plan or compilation.plan_of(module)
    if plan.decision == WHOLE:
        module.forward = _compile(_eager_forward(module), compilation)
    elif plan.decision == APART:
        for name, part in _parts(module):
            _install(part, compilation, plan=plan.parts[name] if name in plan.parts else None)
    elif plan.decision is None:
        module.forward = _FirstCall(module, compilation, plan, kind)


def _eager_forward(module):
    forward = module.forward
    return forward.eager if isinstance(forward, _FirstCall) else forward


def _compile(forward, compilation: Compilation):
    return torch.compile(forward, backend=compilation.backend or "inductor")


class _FirstCall:
    """A module's ``forward`` until its kind is decided: the first call tries the whole module as one graph and
    falls back to its parts (then runs it eagerly around them); a later one follows the decision made."""

    def __init__(self, module, compilation: Compilation, plan: Plan, kind: Kind | None):
        own = module.__dict__.get("forward")  # a forward the module was given (kept: it is its eager forward)
        self.module, self.compilation, self.plan, self.kind = module, compilation, plan, kind
        self.eager, self.own = module.forward, own

    def _restore(self) -> None:
        if self.own is None:
            del self.module.forward
        else:
            self.module.forward = self.own

    def __call__(self, *args, **kwargs):
        module, plan, compilation = self.module, self.plan, self.compilation
        self._restore()
        if plan.decision is None:
            compiled = _compile(self.eager, compilation)
            try:
                with torch._dynamo.error_on_graph_break(True):
                    out = compiled(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as exc:
                parts = dict(_parts(module))
                plan.reason = first_break(exc)
                plan.decision = APART if parts else EAGER
                plan.parts = {name: compilation.plan_of(part) for name, part in parts.items()}
            else:
                plan.decision = WHOLE
                module.forward = compiled
                self._decided()
                return out
        _install(module, compilation, plan=plan)
        out = module.forward(*args, **kwargs)
        self._decided()
        return out

    def _decided(self) -> None:
        if self.kind is None or self.kind.plan is not self.plan:
            return
        if not self.plan.compiled():
            raise UserError(f"MP_COMPILE=true: no part of {self.kind.label} compiles as one graph (first break: "
                            f"{self.plan.reason}): drop MP_COMPILE")
        if self.compilation.on_decided is not None and not self.kind.told:
            self.kind.told = True
            self.compilation.on_decided(self.kind)


def first_break(exc: BaseException) -> str:
    """One line: why dynamo stopped (its explanation where it gives one) and where, in the innermost user frame."""
    text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    why = lines[0] if lines else type(exc).__name__
    explanation = next((line[len("Explanation:"):].strip() for line in lines if line.startswith("Explanation:")),
                       None)
    if explanation:
        why = f"{why}: {explanation}"
    frames = getattr(exc, "real_stack", None)
    if frames:
        frame = frames[-1]
        where = f"{'/'.join(frame.filename.split('/')[-2:])}:{frame.lineno}"
    else:
        found = re.findall(r'File "([^"]+)", line (\d+)', text)
        where = f"{'/'.join(found[-1][0].split('/')[-2:])}:{found[-1][1]}" if found else None
    why = why if len(why) <= 240 else why[:237] + "..."
    return f"{why} ({where})" if where else why


def family_compile_report(family: str, dtype_name: str, fp8: tuple[str, object] | None,
                          core_attention: str | None) -> dict:
    """What MP_COMPILE compiles in ``family``'s tiny model (its layers' code is that of any size), built as a run
    builds it (``dtype_name``, torchao float8 with (recipe, filter) ``fp8``, the core attention) and run once with
    dynamo's graphs left eager (the breaks are dynamo's; no kernels are generated): ``Compilation.report``. The
    forward keeps autograd on, as training's does (the MoE router's auxiliary loss, for one, runs only then). Runs
    in a process of its own (``run_local``): it joins a process group of one."""
    return run_local(_compile_report_worker, 1, family, dtype_name, fp8, core_attention)[0]


def _compile_report_worker(family: str, dtype_name: str, fp8, core_attention) -> dict:
    # imported here: the builder imports this module, so a top-level import would make a cycle
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.models.description.tiny import tiny_config

    init_model_parallel(ParallelLayout())
    arch = parse_arch(tiny_config(family))
    model = build_model(arch, ParallelLayout(), getattr(torch, dtype_name), core_attention=core_attention)
    if fp8 is not None:
        # torchao comes with float8: imported only for an fp8 model
        from megatron_patch.models.blocks import float8

        float8.convert_chunks([model], *fp8, arch.linear_attention)
    compilation = compile_layers([model], backend="eager")
    model(torch.zeros(1, 16, dtype=torch.long), torch.arange(16).unsqueeze(0), None)
    return compilation.report()
