"""The ``mpatch`` command (setup.py's console script; ``python -m mpatch`` too), outside the ``megatron_patch``
package on purpose: Pai-Megatron-Patch's repository holds a top-level ``megatron_patch`` of its own, and with it
first on PYTHONPATH ``from megatron_patch.cli import main`` would end in an ImportError traceback. Here it ends
in one line that says what to change. (The launchers under examples/ put this project first on PYTHONPATH.)
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import signal
import sys
from pathlib import Path

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def foreign_package() -> Path | None:
    """The folder of the ``megatron_patch`` package Python would import, when it is not this project's (found
    without importing it: another project's ``__init__`` may do anything)."""
    spec = importlib.util.find_spec("megatron_patch")
    folders = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    ours = [f for f in folders if (f / "cli" / "__init__.py").is_file() and (f / "training").is_dir()]
    return folders[0] if folders and not ours else None


def megatron_without_core() -> Path | None:
    """The folder of the ``megatron`` package Python would import, when it holds no ``megatron.core`` (an old
    Megatron-LM checkout, a Pai set-up's copy on PYTHONPATH) and so hides the installed megatron-core (found without
    importing it, as above)."""
    spec = importlib.util.find_spec("megatron")
    folders = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    # a regular package (its __init__.py) is searched alone; a namespace package's folders in turn
    searched = folders[:1] if spec is not None and spec.has_location else folders
    if not folders or any((f / "core" / "__init__.py").is_file() for f in searched):
        return None
    return folders[0]


def main() -> int:
    other = foreign_package()
    if other is not None:
        print(f"mpatch: error: the megatron_patch package found first, {other}, is not this project's (Pai-Megatron-"
              f"Patch's repository has one of that name): take {other.parent} off PYTHONPATH to run mpatch (Pai's "
              "scripts put it there themselves)", file=sys.stderr)
        return EXIT_BAD_INPUT
    hiding = megatron_without_core()
    if hiding is not None:
        try:
            installed = f" and hides the installed megatron-core {importlib.metadata.version('megatron-core')}"
        except importlib.metadata.PackageNotFoundError:
            installed = ""
        print(f"mpatch: error: the megatron package found first, {hiding}, holds no megatron.core{installed}: take "
              f"{hiding.parent} off PYTHONPATH (or make it a Megatron-LM checkout of megatron-core 0.16 or 0.19)",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    from megatron_patch.cli import main as run

    code = run()
    if code == EXIT_INTERRUPTED:
        # It has said "interrupted" and left nothing behind: a second signal while the interpreter shuts down (a
        # scheduler's SIGTERM to the whole group reaches the ranks too) must not turn the 130 a script reads into a
        # death by that signal.
        for number in (signal.SIGINT, signal.SIGTERM):
            signal.signal(number, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(main())
