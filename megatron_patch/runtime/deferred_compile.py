"""megatron-core's ``torch.compile`` decorations, deferred from its import to each function's first call, and on
CPU not compiled at all unless a run asks for compiled fusions.

megatron-core decorates about 30 functions with ``torch.compile`` when it is imported (``megatron.core.jit``'s
``jit_fuser``: fused bias-GeLU/SwiGLU, router and dispatcher helpers; 0.19 also ``@torch.compile`` itself).
Decorating imports torch's compiler stack, dynamo and inductor, in every process that imports megatron-core
(each rank of a launch, each tool), whether or not it ever calls one of those functions: ``import
megatron.core.models.gpt`` takes 4.3 s on an idle 2-core machine, 2.6 s deferred (scripts/bench_imports.py).
torch.compile compiles at a function's first call anyway; here the decoration waits for that call too.

Some of them are called whatever the run's fusion settings: every MoE router's ``_apply_expert_bias`` (a no-op
unless the model has expert bias), gated attention's output gate, gpt-oss's activation. On CPU their first call
cost each process 2.0 s (a no-op traced) to 3.6 s (DeepSeek-V3's expert bias: a C++ kernel built) on an idle
2-core machine, more under load, and needed a C++ compiler (scripts/bench_imports.py, the "first call" lines). So
the run's fusion setting decides (MP_COMPILE_FUSIONS, ``set_megatron_fusions``): compiled where it is true, eager
where it is false, and unset as megatron-core's other fusions are by default here, compiled on a GPU and eager on
CPU. Eager and compiled compute the same function (the tests hold the compiled fusions to eager's losses).

Installed by the entry points (``cli.main``, ``rank_preload``) before megatron-core is imported; where it was
imported already, nothing changes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
import types

# torch is imported inside the functions: `mpatch` installs the finder at start-up, and `mpatch convert` runs
# without torch.

PACKAGE = "megatron.core"


def deferred_compile(fn=None, **options):
    """``torch.compile(fn, **options)`` made at ``fn``'s first call where fusions are compiled (a module or other
    callable: at once), else ``fn`` itself. Inside a region torch.compile is tracing, the plain function is called:
    dynamo inlines a compiled function's original there too."""
    import torch

    if fn is None:  # used as @torch.compile(**options)
        return functools.partial(deferred_compile, **options)
    if not isinstance(fn, types.FunctionType):
        return _real_compile()(fn, **options)
    compiled = []

    @functools.wraps(fn)
    def first_call_compiles(*args, **kwargs):
        if torch.compiler.is_compiling() or not fusions_compiled():
            return fn(*args, **kwargs)
        if not compiled:
            compiled.append(_real_compile()(fn, **options))
        return compiled[0](*args, **kwargs)

    return first_call_compiles


_COMPILE_FUSIONS: list = [None]  # the run's MP_COMPILE_FUSIONS: True, False, or None (unset)
_ON_GPU: list = []  # whether this process has a CUDA device, asked once


def fusions_compiled() -> bool:
    """Whether megatron-core's jit-fused functions run compiled in this process (the module's docstring says why)."""
    if _COMPILE_FUSIONS[0] is not None:
        return _COMPILE_FUSIONS[0]
    if not _ON_GPU:
        import torch

        _ON_GPU.append(torch.cuda.is_available())
    return _ON_GPU[0]


def set_megatron_fusions(compiled: bool | None) -> None:
    """A run's MP_COMPILE_FUSIONS: True compiles megatron-core's jit-fused functions, False runs them eager, None
    leaves it to the device (compiled on a GPU, eager on CPU)."""
    _COMPILE_FUSIONS[0] = compiled


@contextlib.contextmanager
def compiled_megatron_fusions(compiled: bool | None = True):
    """``set_megatron_fusions(compiled)`` for the ``with`` block, the setting before it restored after."""
    before = _COMPILE_FUSIONS[0]
    set_megatron_fusions(compiled)
    try:
        yield
    finally:
        set_megatron_fusions(before)


_REAL_COMPILE: list = []  # torch.compile itself, kept by the finder before it swaps it


def _real_compile():
    import torch

    return _REAL_COMPILE[0] if _REAL_COMPILE else torch.compile


class _DeferMegatronCompile(importlib.abc.MetaPathFinder):
    """Finds each megatron-core module as Python would, and runs it with ``torch.compile`` deferred (nested imports
    put back what they found, so the real one returns when the outermost megatron-core module is done)."""

    def find_spec(self, name, path, target=None):
        if name != PACKAGE and not name.startswith(PACKAGE + "."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            import torch

            if not _REAL_COMPILE:
                _REAL_COMPILE.append(torch.compile)
            found, torch.compile = torch.compile, deferred_compile
            try:
                run_module(module)
            finally:
                torch.compile = found

        spec.loader.exec_module = exec_module  # this spec's own loader instance
        return spec


def defer_megatron_compile() -> None:
    """Install the finder (once); a no-op where megatron-core is imported already."""
    if PACKAGE not in sys.modules and not any(isinstance(f, _DeferMegatronCompile) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeferMegatronCompile())
