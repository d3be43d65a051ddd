"""Process groups, device selection and the CPU compatibility layer for megatron-core."""

from megatron_patch.runtime.distributed import (  # noqa: F401
    ParallelLayout, backend, destroy, device, init_model_parallel, init_process_group, set_seed,
)
