"""``python -m megatron_patch``: the ``mpatch`` command (mpatch.py), with its check that the ``megatron_patch`` package
Python imports is this project's. With Pai-Megatron-Patch's repository first on PYTHONPATH, Python runs this file (an
editable install finds it) while importing Pai's package of that name: an ImportError traceback, now mpatch's one
line."""

import sys

try:
    from mpatch import main
except ImportError:  # mpatch.py installed apart from the package, or not at all: the package's own entry
    from megatron_patch.cli import main

if __name__ == "__main__":
    sys.exit(main())
