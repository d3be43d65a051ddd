"""Imported once by a fork server, so that each local rank forks with torch and megatron-core already imported
instead of importing them itself: about 4 s of CPU per rank on 2 cores (megatron-core pulls in torch's
distributed-tensor and symbolic-shape stacks), which a training launch at TP=2, a parity check at TP=2 or a test
suite of multi-process checks pays over and over. ``local_job_preload`` adds transformers for ``run_local``'s
jobs (the HF side of a parity check or an alignment); a training rank does not import it.

The CPU compatibility layer is enabled first, because it must patch torch before megatron-core binds
names at import. Any failure here is left for the rank to meet again and report itself (an unsupported
megatron-core release refused in one line, say): the fork server only imports what it can.
"""

try:
    from megatron_patch.runtime import cpu_compat
    from megatron_patch.runtime.deferred_compile import defer_megatron_compile
    from megatron_patch.runtime.known_warnings import quiet_known_warnings

    quiet_known_warnings()  # the fork server is an entry point of its own: its imports would print them
    defer_megatron_compile()

    cpu_compat.enable()
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401 - the model models/blocks/builder.py builds
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    # torch's optimizers import dynamo when the first is built (Optimizer.__init__ is dynamo-disabled): 0.5 s a rank
    import torch._dynamo  # noqa: F401
except Exception:  # noqa: BLE001 - see the module's docstring
    pass
