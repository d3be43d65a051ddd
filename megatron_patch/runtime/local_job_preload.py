"""Imported once by ``run_local``'s fork server: a training rank's imports (``rank_preload``) and transformers,
which the HF side of a parity check, an alignment or an evaluation imports in each rank (0.6-0.9 s)."""

try:
    import megatron_patch.runtime.rank_preload  # noqa: F401
    import transformers  # noqa: F401
except Exception:  # noqa: BLE001 - as in rank_preload: the rank meets any failure again and reports it
    pass
