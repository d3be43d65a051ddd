"""Modules imported on first use, so that commands which never touch them start fast.

``import torch`` alone takes 1.5-3 s on a small machine, ``import megatron.core`` several more; a
checkpoint conversion whose bytes go file to file needs neither. Modules that name ``torch`` only
inside functions hold a ``LazyModule`` in its place: the first attribute looked up imports it.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class LazyModule:
    """Stands for module ``name``; the first attribute access imports it (then Python's cache)."""

    def __init__(self, name: str):
        self.__dict__["_name"] = name

    def __getattr__(self, attr: str):
        module: ModuleType = importlib.import_module(self.__dict__["_name"])
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self.__dict__['_name']}>"
