"""Checkpoint identity and model I/O: what a checkpoint folder holds and which model it is, and weights moved
between it (or an HF folder) and a live model. The converter, LoRA, training and the aligner all need this, so it
sits below them and imports none of them.

- ``sidecar``: the ``mpatch_checkpoint.json`` every checkpoint written here carries;
- ``foreign``, ``arch_source``, ``inspect``: any Megatron-Core checkpoint's files, its model, its summary;
- ``legacy``: Megatron's per-rank ``model_optim_rng.pt`` files, named by their rank's coordinates;
- ``hf_reader``: an HF folder's safetensors, read lazily;
- ``engine``, ``model_io``, ``loading``: a family's weight table run in memory, into and out of a live model;
- ``outputs``: the output folders (complete or absent) and the side files that travel with the weights.
"""
