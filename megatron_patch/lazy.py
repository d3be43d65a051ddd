"""Modules imported on first use, so that commands which never touch them start fast.

``import torch`` alone takes 1.5-3 s on a small machine, ``import megatron.core`` several more; a
checkpoint conversion whose bytes go file to file needs neither. Modules that name ``torch`` only
inside functions hold a ``LazyModule`` in its place: the first attribute looked up imports it.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

_ALL: list["LazyModule"] = []


class LazyModule:
    """Stands for module ``name`` in module ``owner``'s globals; the first attribute access imports it and puts the
    real module there in its place (so code that runs later, compiled code included, sees the module itself)."""

    def __init__(self, name: str, owner: str):
        self.__dict__["_name"] = name
        self.__dict__["_owner"] = owner
        _ALL.append(self)

    def __getattr__(self, attr: str):
        return getattr(self._resolve(), attr)

    def _resolve(self) -> ModuleType:
        module: ModuleType = importlib.import_module(self.__dict__["_name"])
        owner = sys.modules.get(self.__dict__["_owner"])
        for key, value in list(vars(owner).items()) if owner is not None else ():
            if value is self:
                setattr(owner, key, module)
        return module

    def __repr__(self) -> str:
        return f"<lazy module {self.__dict__['_name']}>"


def resolve_all() -> None:
    """Import every lazy module now and put it in its owner's globals. torch.compile cannot trace the import a
    ``LazyModule`` makes at its first use: a compiled layer whose code met one there (LoRA's adapters, through the
    weight splits) broke its graph at it."""
    for lazy in _ALL:
        lazy._resolve()
