"""LoRA through the converter: a peft adapter into a checkpoint beside its base (``hf2mcore --peft-dir``), and a
checkpoint's adapters out as a peft folder (``mcore2hf --lora-adapter``) or merged into the HF weights
(``mcore2hf --merge-lora``).

The merge exports the base as ``mcore_to_hf`` does (byte moves), then rewrites each adapted HF tensor in
place, one at a time: W read from the base in its stored dtype, plus scaling * B @ A in float32, cast once to
the exported dtype. Peak memory is one fused weight in float32 and the adapters. modules_to_save weights
replace the base's.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megatron_patch.checkpoint.arch_source import open_checkpoint
from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
from megatron_patch.checkpoint.outputs import atomic_output_dir
from megatron_patch.checkpoint_files.byte_io import write_all
from megatron_patch.checkpoint_files.manifest import MANIFEST_NAME, manifest_for, verify_manifest
from megatron_patch.convert.checkpoint import mcore_to_hf
from megatron_patch.convert.copier import cast
from megatron_patch.convert.stacked import StackedView
from megatron_patch.dtypes import dtype_name, precision_dtype
from megatron_patch.errors import UserError
from megatron_patch.lora.peft_io import read_peft_adapter, write_peft_adapter
from megatron_patch.lora.plan import plan_sites
from megatron_patch.lora.saved import stored_hf_tensors, stored_saved_tensors
from megatron_patch.lora.spec import LoraSpec
from megatron_patch.lora.state import check_adapter_keys, find_base, read_adapter_tensors
from megatron_patch.models.description.registry import get_family, parse_arch

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).


@dataclass
class PeftImport:
    """A peft adapter read for ``hf_to_mcore``: its tensors under checkpoint keys, the modules_to_save weights
    (HF names) that replace the base's, and the sidecar's ``lora`` section."""

    spec: LoraSpec
    tensors: dict
    saved: dict = field(default_factory=dict)

    @property
    def sidecar(self) -> dict:
        return {"spec": self.spec.to_dict(), "base": None}  # the base weights are in the same checkpoint

    def reader(self, reader):
        return _OverridingReader(reader, self.saved)


class _OverridingReader:
    """An HF reader that shows the modules_to_save weights of an adapter in place of the base's (computed
    tensors for the converter: ``stored`` None, read through torch)."""

    def __init__(self, reader, overrides: dict):
        self.reader, self.overrides, self.folder = reader, overrides, reader.folder
        for name, t in overrides.items():
            if name not in reader:
                raise UserError(f"the adapter saves {name}, which the base model does not have")
            if tuple(t.shape) != tuple(reader.shape(name)):
                raise UserError(f"the adapter saves {name} of shape {tuple(t.shape)}; the base's is "
                                f"{tuple(reader.shape(name))}: the adapter was made for another base model")

    def keys(self):
        return self.reader.keys()

    def __contains__(self, name):
        return name in self.reader

    def stored(self, name):
        return None if name in self.overrides else self.reader.stored(name)

    def get(self, name):
        return self.overrides[name] if name in self.overrides else self.reader.get(name)

    def dtype(self, name):
        return dtype_name(self.overrides[name].dtype) if name in self.overrides else self.reader.dtype(name)

    def shape(self, name):
        return self.reader.shape(name)

    def nbytes(self, name):
        return self.reader.nbytes(name)


def read_peft_import(peft_dir: str | Path, hf_dir: str | Path) -> PeftImport:
    spec, tensors, saved = read_peft_adapter(peft_dir, parse_arch(hf_dir))
    return PeftImport(spec, tensors, saved)


# --- out of a LoRA checkpoint ------------------------------------------------------------------------------------

def _open(load_dir, iteration, verify: bool = True):
    opened = open_checkpoint(load_dir, iteration=iteration, verify=verify)
    for note in opened.found.notes:  # a damaged newest iteration skipped, as plain mcore2hf says it
        print(f"warning: {note}", file=sys.stderr, flush=True)
    if not opened.sidecar.lora:
        raise UserError(f"{load_dir} holds no LoRA adapters: --lora-adapter and --merge-lora export a LoRA run's "
                        "checkpoint (or one converted with --peft-dir); export this one without them")
    return opened


def _adapters(opened, verify: bool = True):
    """(spec, sites, whole adapter tensors, modules_to_save HF tensors) of a LoRA checkpoint, its files checked
    against its manifest first (``verify``)."""
    manifest = manifest_for(opened.found.folder) if verify else None
    if manifest is not None:
        verify_manifest(manifest)

    arch = opened.model_arch
    spec = LoraSpec.from_dict(opened.sidecar.lora["spec"])
    sites = plan_sites(arch, spec)
    tensors = read_adapter_tensors(opened.found.folder)
    check_adapter_keys(sites, tensors, str(opened.found.folder))
    return arch, spec, sites, tensors, stored_saved_tensors(opened.found.folder, arch, spec)


def export_adapter(load_dir: str | Path, save_dir: str | Path, *, dtype=None, force: bool = False,
                   iteration: int | None = None, verify: bool = True) -> Path:
    """A peft adapter folder from a LoRA checkpoint: peft's key names and config; ``dtype`` (a precision
    name) casts the tensors, else they keep the checkpoint's."""
    opened = _open(load_dir, iteration, verify)
    arch, spec, sites, tensors, saved = _adapters(opened, verify)
    base = opened.sidecar.lora.get("base")
    with atomic_output_dir(save_dir, force, tool="mpatch convert mcore2hf --lora-adapter", inputs=(load_dir,)) as tmp:
        write_peft_adapter(tmp, sites, spec, arch, tensors, saved, base=_hf_base(opened, base),
                           dtype=None if dtype is None else precision_dtype(dtype))
    return Path(save_dir)


def _hf_base(opened, base: dict | None) -> str | None:
    """peft's base_model_name_or_path: the HF folder the adapters' base was converted from, as its conversion
    recorded it (None where none is: a megatron-core checkpoint is no model peft's AutoPeftModel can load)."""
    source = opened.sidecar.source
    if base is not None:
        try:
            source = open_checkpoint(base["path"]).sidecar.source
        except (UserError, OSError):
            source = ""
    return source if source and Path(source).is_absolute() else None


def merge_adapter(load_dir: str | Path, save_dir: str | Path, *, base_dir: str | Path | None = None, dtype=None,
                  force: bool = False, iteration: int | None = None, progress: bool | None = None,
                  workers: int | None = None, max_shard_size: str | int = "5GB", verify: bool = True) -> Path:
    """The HF model with a LoRA checkpoint's adapters merged in (W + scaling * B @ A in float32, then cast)."""
    opened = _open(load_dir, iteration, verify)
    arch, spec, sites, tensors, saved = _adapters(opened, verify)
    record = opened.sidecar.lora.get("base")
    if record is None:
        if base_dir is not None:
            raise UserError(f"{load_dir} carries its base weights itself: drop --base-dir")
        base = opened.found.root
    else:
        base = find_base(record, base_dir, str(load_dir), "--base-dir")
    base_opened = opened if record is None else open_checkpoint(base)
    # The adapted weights are read from the base in the dtype it stores them in, so a --dtype narrower than
    # that rounds the merged sum once, as the cast of a float32 merge does; a legacy base is read through its
    # export instead (W already in --dtype).
    exact_from = base_opened.found.folder if base_opened.sidecar.checkpoint_format == "torch_dist" else None
    if exact_from is None and dtype is not None and dtype not in ("fp32", base_opened.sidecar.dtype):
        print(f"note: the base {base} is a legacy checkpoint, whose weights are merged as exported in {dtype}: "
              f"rounded before the adapters' product is added (--dtype {base_opened.sidecar.dtype} is the exact "
              "merge)", file=sys.stderr, flush=True)
    with atomic_output_dir(save_dir, force, tool="mpatch convert mcore2hf --merge-lora", inputs=(load_dir, base)) as tmp:
        # the base exported as plain mcore2hf does it, then moved up (its manifest is written again at the end)
        staged = tmp / "base"
        mcore_to_hf(base, staged, dtype=dtype, max_shard_size=max_shard_size, progress=progress, workers=workers,
                    base_only=True, verify=verify)
        for path in staged.iterdir():
            if path.name == MANIFEST_NAME:
                path.unlink()
            else:
                path.rename(tmp / path.name)
        staged.rmdir()
        merged = _merge_in_place(tmp, arch, sites, spec, tensors, saved, exact_from)
        print(f"merged {merged} adapted weight(s) in float32", file=sys.stderr, flush=True)
    return Path(save_dir)


def _merge_in_place(folder: Path, arch, sites, spec: LoraSpec, tensors: dict, saved: dict,
                    base_folder: Path | None) -> int:
    """Each adapted HF tensor of the export in ``folder`` rewritten as W + scaling * B @ A (float32, then cast to
    the exported tensor's dtype), W read from the torch_dist checkpoint ``base_folder`` in its stored dtype
    (None: from the export itself), and the modules_to_save weights written over the base's."""
    import torch

    # stacked experts (gpt-oss) read and written as the table's members: each one's bytes within its stack
    reader = StackedView(HFCheckpointReader(folder), get_family(arch.family).hf_stacked(arch))

    def rewrite(name: str, tensor) -> None:
        place = reader.stored(name)
        data = cast(tensor, place.dtype, name).contiguous().reshape(-1)
        fd = os.open(place.path, os.O_WRONLY)
        try:
            write_all(fd, data.view(torch.uint8).numpy(), place.offset)
        finally:
            os.close(fd)

    pending = {}  # HF name -> (site, the adapter covering it, its first row in B)
    for site in sites:
        for part, hf_name in enumerate(site.hf_names):
            cover = site.covering(part)
            if cover is not None:
                pending[hf_name] = (site, part, *cover)

    def merge(hf_name: str, weight) -> None:
        site, part, i, first = pending.pop(hf_name)
        a = site.adapters[i]
        b = tensors[a.key_b][first:first + site.part_rows[part]].float()
        weight = weight.float()
        delta = spec.scaling(a.rank, a.alpha) * (b @ tensors[a.key_a].float())
        weight += delta.t() if site.rule.split.transposed else delta  # gpt-oss's experts: stored [in, out]
        rewrite(hf_name, weight)

    count = len(pending)
    if base_folder is not None:
        for weights in stored_hf_tensors(base_folder, arch, list({id(s.rule): s.rule for s in sites}.values())):
            for hf_name, weight in weights.items():
                if hf_name in pending:
                    merge(hf_name, weight)
    for hf_name in list(pending):  # none left from a torch_dist base; each of a legacy one's
        merge(hf_name, reader.get(hf_name))
    for name, tensor in saved.items():
        rewrite(name, tensor.float())
    return count
