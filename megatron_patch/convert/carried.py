"""HF tensors that are not part of the MCore model but travel with it (Qwen3.5's vision tower).

A family names them (``ModelFamily.hf_carried``). ``hf2mcore`` byte-copies them, dtype and all, into one
safetensors file beside the checkpoint's weights (``carried_tensors.safetensors``, listed among the
sidecar's carried files, so training runs carry it into their checkpoints as they carry the tokenizer);
``mcore2hf`` writes them back among the exported tensors, so the export is the whole HF checkpoint
again, bit-exact. Nothing trains them.
"""

from __future__ import annotations

from pathlib import Path

from megatron_patch.checkpoint.hf_reader import read_safetensors_header
from megatron_patch.checkpoint_files.byte_io import Stored
from megatron_patch.convert.hf_writer import plan_safetensors
from megatron_patch.input_files import checked_input

CARRIED_TENSORS = "carried_tensors.safetensors"


def write_carried_plan(folder: Path, sources: dict[str, Stored]) -> dict[str, Stored]:
    """Lay out ``CARRIED_TENSORS`` in ``folder`` for ``sources`` (name -> where its bytes are): the file's
    header is written; each tensor's place is returned, for the bytes to be copied into."""
    names = sorted(sources)
    plan = plan_safetensors(folder, [(n, sources[n].shape, sources[n].dtype) for n in names], max_shard_bytes=1 << 62,
                            file_name=CARRIED_TENSORS)
    plan.write_headers()
    return plan.stored


def read_carried(folder: Path) -> dict[str, Stored]:
    """The tensors of the ``CARRIED_TENSORS`` a checkpoint's sidecar lists: one that is not there, or not a file,
    is refused in one line (an export without the vision tower was written with exit 0: the hostile audit)."""
    path = Path(folder) / CARRIED_TENSORS
    checked_input(path, inside=folder, limit=None, hint="the checkpoint's sidecar lists it among its carried files, "
                  "so the checkpoint is incomplete: copy it again from where it was written")
    return dict(sorted(read_safetensors_header(path).items()))
