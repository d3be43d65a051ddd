"""FL=true without transformer-engine: which kernel torch SDPA runs on a machine, as the dry run and the training log
name it (models/blocks/attention_kernels.py), with the GPU faked."""

from __future__ import annotations

from megatron_patch.runtime.machine import Capabilities
from megatron_patch.training.machine_checks import attention_kernel
from megatron_patch.training.validation import resolve
from tests.training_helpers import launcher_args

H100 = Capabilities(cuda=True, transformer_engine=False, fp8=False, flash_attention_3=False, compute_capability=(9, 0),
                    cuda_version="13.0", torch_version="2.11.0+cu130")


def _kernel(caps, family="llama3_1", **over) -> str:
    cfg = resolve(family, launcher_args(family, **{"ENV": "dsw", "PR": "bf16", "FL": "true", **over}),
                  env={"GPUS_PER_NODE": "1"}, check_paths=False)
    return attention_kernel(cfg, caps)


def test_each_gpu_names_the_kernel_torch_sdpa_runs():
    assert _kernel(H100).endswith("cuDNN SDPA (torch's preferred kernel on Hopper and later from 2.11)")
    older_torch = Capabilities(**{**H100.__dict__, "torch_version": "2.10.0"})
    assert _kernel(older_torch).endswith("torch flash SDPA (FlashAttention-2's kernel, built into torch)")
    a100 = Capabilities(**{**H100.__dict__, "compute_capability": (8, 0)})
    assert _kernel(a100).endswith("torch flash SDPA (FlashAttention-2's kernel, built into torch)")
    fa3 = Capabilities(**{**H100.__dict__, "flash_attention_3": True})
    assert "FlashAttention-3 through torch SDPA (torch.nn.attention.activate_flash_attention_impl('FA3'))" in _kernel(fa3)
    fa4 = Capabilities(**{**fa3.__dict__, "flash_attention_4": True})
    assert "FlashAttention-4 through torch SDPA" in _kernel(fa4)
    assert "FlashAttention-3" in _kernel(Capabilities(**{**fa3.__dict__, "compute_capability": (9, 0)}))
    assert "memory-efficient kernel (fp32" in _kernel(H100, PR="fp32")
    cpu = Capabilities(cuda=False, transformer_engine=False, fp8=False, flash_attention_3=False)
    assert _kernel(cpu, ENV="cpu").endswith("torch SDPA, CPU flash kernel")


def test_families_whose_masks_sdpa_cannot_take_name_their_fallback():
    assert _kernel(H100, "gpt_oss", ETP="1").endswith(
        "layers with sliding windows and attention sinks fall back to megatron-core's unfused attention")
    assert "fall back" not in _kernel(H100)
