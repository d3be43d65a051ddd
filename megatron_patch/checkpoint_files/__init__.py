"""Checkpoint files, model-free: the formats (torch.save zips and their pickles, torch_dist, the tracker and
iteration folders) read and written without torch, and, since every one of them is untrusted input, the one
allow-list of what their pickles may name with the torch-side readers that apply it (nothing in a checkpoint
runs code; docs/security.md). Nothing here knows a model or a parallel layout: which rank's file holds what is
``megatron_patch.checkpoint``'s (``checkpoint/legacy.py`` names Megatron's per-rank files). convert, training,
align and inspect all read checkpoints through here.
"""
