"""Outputs that nothing can clobber: one writer per output (a lock next to it), folders published by renames
that cannot replace what they should not, and what earlier runs left found through the lock
(docs/outputs.md)."""
