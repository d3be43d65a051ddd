#!/usr/bin/env python
"""Pai-Megatron-Patch's preprocess_data_megatron.py, its flags unchanged, over `mpatch preprocess` (see its --help, and
docs/coming-from-pai.md, "Data")."""

import sys

from megatron_patch.cli import main

if __name__ == "__main__":
    sys.exit(main(["preprocess", *sys.argv[1:]]))
