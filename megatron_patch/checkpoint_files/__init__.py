"""Checkpoint files as untrusted input: the one allow-list of what their pickles may name, and the
torch-side readers that apply it (nothing in a checkpoint runs code; docs/security.md)."""
