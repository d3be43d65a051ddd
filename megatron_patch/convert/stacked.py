"""Stacked HF tensors (``models/mapping/stacks.py``) in the streaming converter.

Reading, ``StackedView`` shows a reader's stacked tensors as their members: each member's shape, dtype
and place (a contiguous byte range inside the stacked tensor, so moves stay file to file), and its
values when asked for (a dequantizing reader below it gives one member at a time: ``get_member``).
Writing, ``stack_entries`` turns the members the weight table writes into the stacked tensors the
checkpoint holds, and ``member_places`` gives each member its part of the stacked tensor's place.
"""

from __future__ import annotations

import dataclasses

from megatron_patch.checkpoint_files.byte_io import Stored, read_range
from megatron_patch.errors import UserError
from megatron_patch.models.mapping.stacks import Stacks, member_index

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).


def member_place(stacked: Stored, index: int) -> Stored:
    member = Stored(stacked.path, stacked.offset, tuple(stacked.shape[1:]), stacked.dtype)
    return dataclasses.replace(member, offset=stacked.offset + index * member.nbytes)


class StackedView:
    """``reader`` (an ``HFCheckpointReader`` or a dequantizing view of one) with stacked tensors shown as
    their members; every other name passes through."""

    def __init__(self, reader, stacks: Stacks):
        self.reader, self.index, self.folder = reader, member_index(stacks), reader.folder
        for name, members in stacks.items():
            if name in reader and (not reader.shape(name) or reader.shape(name)[0] != len(members)):
                raise UserError(f"{name} has shape {tuple(reader.shape(name))}, config.json implies {len(members)} "
                                "experts along its first dimension")
        self.stacked = {name for name in stacks if name in reader}

    def keys(self) -> list[str]:
        return sorted([n for n in self.reader.keys() if n not in self.stacked]
                      + [m for m, (s, _) in self.index.items() if s in self.stacked])

    def __contains__(self, name: str) -> bool:
        return self.index[name][0] in self.stacked if name in self.index else name in self.reader

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.reader.shape(self.index[name][0]))[1:] if name in self.index else self.reader.shape(name)

    def dtype(self, name: str) -> str:
        return self.reader.dtype(self.index[name][0] if name in self.index else name)

    def stored(self, name: str):
        if name not in self.index:
            return self.reader.stored(name)
        stacked, i = self.index[name]
        place = self.reader.stored(stacked)
        return None if place is None else member_place(place, i)

    def nbytes(self, name: str) -> int:
        if name not in self.index:
            return self.reader.nbytes(name)
        stacked, _ = self.index[name]
        return self.reader.nbytes(stacked) // self.reader.shape(stacked)[0]

    def get(self, name: str):
        if name not in self.index:
            return self.reader.get(name)
        stacked, i = self.index[name]
        place = self.stored(name)
        if place is None:  # computed (dequantized): one member at a time where the reader can
            get_member = getattr(self.reader, "get_member", None)
            return get_member(stacked, i) if get_member else self.reader.get(stacked)[i]
        import torch

        data = read_range(place.path, place.offset, place.nbytes)
        return torch.frombuffer(data, dtype=getattr(torch, place.dtype)).reshape(place.shape) if data else \
            torch.empty(place.shape, dtype=getattr(torch, place.dtype))


def stack_entries(entries: list[tuple[str, tuple[int, ...], str]], stacks: Stacks) -> list[tuple[str, tuple[int, ...], str]]:
    """The safetensors entries (name, shape, dtype) with each stack's members replaced by the stacked tensor,
    where its first member was."""
    index, out, done = member_index(stacks), [], set()
    for name, shape, dtype in entries:
        if name not in index:
            out.append((name, shape, dtype))
        elif index[name][0] not in done:
            stacked = index[name][0]
            done.add(stacked)
            out.append((stacked, (len(stacks[stacked]), *shape), dtype))
    return out


def member_places(places: dict[str, Stored], stacks: Stacks) -> dict[str, Stored]:
    """``places`` with each member's part of its stacked tensor added."""
    return {**places, **{m: member_place(places[s], i) for m, (s, i) in member_index(stacks).items() if s in places}}
