"""DeepSeek-V4 (deepseek_v4): the family's own modules, being built; not a registered family yet (docs/deepseek.md)."""
