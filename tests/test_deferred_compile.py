"""megatron-core's torch.compile decorations wait for each function's first call (runtime/deferred_compile.py):
importing megatron-core no longer imports torch's compiler stack, and what the functions compute is unchanged;
they are compiled when called where the run's fusions are (MP_COMPILE_FUSIONS, else a GPU), and run eager on CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatron_patch.runtime import deferred_compile as deferred_compile_module
from megatron_patch.runtime.deferred_compile import compiled_megatron_fusions, deferred_compile, fusions_compiled

IMPORT_MEGATRON = """
import sys
{install}
import megatron.core.dist_checkpointing, megatron.core.models.gpt, megatron.core.optimizer
import megatron.core.pipeline_parallel, megatron.core.transformer.moe.router, megatron.core.fusions.fused_bias_swiglu
from megatron.core import jit
from megatron.core.fusions import fused_bias_swiglu
print("torch._dynamo" in sys.modules, "torch._inductor.compile_fx" in sys.modules, jit.jit_fuser.__name__,
      type(fused_bias_swiglu.swiglu).__name__)
"""


def _import_megatron(install: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", IMPORT_MEGATRON.format(install=install)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


def test_importing_megatron_core_leaves_the_compiler_stack_out():
    plain = _import_megatron("")
    assert plain[:3] == ["True", "True", "compile"], plain  # what megatron-core does on its own
    deferred = _import_megatron("from megatron_patch.runtime.deferred_compile import defer_megatron_compile\n"
                                "defer_megatron_compile()")
    assert deferred == ["False", "False", "deferred_compile", "function"], deferred


def test_the_entry_points_install_it_before_megatron_core_is_imported():
    proc = subprocess.run([sys.executable, "-c", "import sys\nfrom megatron_patch.cli import main\n"
                           "main(['families'])\nimport megatron.core\nprint('torch._dynamo' in sys.modules)"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "False", proc.stdout[-500:] + proc.stderr[-2000:]
    preload = subprocess.run([sys.executable, "-c", "import sys\nimport megatron_patch.runtime.rank_preload\n"
                              "print('megatron.core.models.gpt' in sys.modules, 'torch._dynamo' in sys.modules, "
                              "'torch._inductor.compile_fx' in sys.modules)"],
                             capture_output=True, text=True, timeout=300)
    # dynamo on purpose (every training rank's optimizer imports it when built), the compiler's back end not
    assert preload.stdout.split() == ["True", "True", "False"], preload.stdout[-500:] + preload.stderr[-2000:]


def _gated(x, y):
    return torch.nn.functional.silu(x) * y


def _scaled(x, y):  # a second function: dynamo caches compiled code by function
    return x * 2 + y


def _shifted(x, y):  # the eager test's own
    return x - y


def _recording_backend(calls: list):
    def backend(graph, example_inputs):  # a torch.compile backend that records what it was given
        calls.append(len(example_inputs))
        return graph.forward
    return backend


def test_a_deferred_function_compiles_at_its_first_call_and_computes_the_same():
    calls = []
    backend = _recording_backend(calls)
    fn = deferred_compile(_gated, backend=backend)
    assert fn.__name__ == "_gated" and calls == []
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with compiled_megatron_fusions(True):  # MP_COMPILE_FUSIONS=true
        assert torch.equal(fn(x, y), _gated(x, y)) and calls == [2]
        fn(x, y)
        assert calls == [2]  # compiled once
        decorated = deferred_compile(backend=backend)(_scaled)  # the @decorator(**options) form
        assert calls == [2] and torch.equal(decorated(x, y), _scaled(x, y)) and calls == [2, 2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU an unset MP_COMPILE_FUSIONS compiles")
def test_on_cpu_the_functions_run_eager_unless_the_run_compiles_fusions():
    """The router's expert-bias update, gated attention's output gate and such are called by every MoE or gated
    model whatever its fusion settings: traced and compiled on CPU, their first call cost each process seconds and
    needed a C++ compiler. Eager where MP_COMPILE_FUSIONS is unset or false; compiled where it is true, and back to
    eager after."""
    calls = []
    fn = deferred_compile(_shifted, backend=_recording_backend(calls))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    assert not fusions_compiled() and torch.equal(fn(x, y), _shifted(x, y)) and calls == []
    with compiled_megatron_fusions(False):
        assert torch.equal(fn(x, y), _shifted(x, y)) and calls == []
    with compiled_megatron_fusions(True):
        assert fusions_compiled() and torch.equal(fn(x, y), _shifted(x, y)) and calls == [2]
    assert not fusions_compiled() and torch.equal(fn(x, y), _shifted(x, y)) and calls == [2]


def test_inside_a_compiled_region_the_function_is_traced_without_a_graph_break():
    fn = deferred_compile(_gated)
    outer = torch.compile(lambda x, y: fn(x, y) + 1, fullgraph=True, backend="eager")  # fullgraph: a break raises
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    assert torch.allclose(outer(x, y), _gated(x, y) + 1)


def test_unset_the_device_decides_and_the_option_overrides_it(monkeypatch):
    """Unset: compiled where this process has a CUDA device (megatron-core's own fusions on a GPU), eager where not;
    MP_COMPILE_FUSIONS=true or false decides on either."""
    for gpu in (True, False):
        monkeypatch.setattr(deferred_compile_module, "_ON_GPU", [gpu])
        assert fusions_compiled() is gpu
        for asked in (True, False):
            with compiled_megatron_fusions(asked):
                assert fusions_compiled() is asked
        assert fusions_compiled() is gpu
