"""Running HF and MCore side by side and judging their agreement."""
