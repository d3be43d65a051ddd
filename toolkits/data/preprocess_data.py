#!/usr/bin/env python
"""JSONL -> Megatron mmap data; the same as `mpatch preprocess` (see its --help)."""

import sys

from megatron_patch.cli import main

if __name__ == "__main__":
    sys.exit(main(["preprocess", *sys.argv[1:]]))
