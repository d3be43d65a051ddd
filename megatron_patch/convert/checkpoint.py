"""HF model folder <-> MCore checkpoint folder: what ``mpatch convert`` runs.

A conversion is planned completely before any tensor byte moves:

1. every check that needs no weights: config.json, the layout, every input tensor's presence, shape
   and dtype against what megatron-core builds for that config (``skeleton``), the input files'
   headers;
2. the output layout: each output file's headers, pickles and directory, and the exact byte range of
   every tensor in it (``torch_files``, ``torch_dist``, ``hf_writer``), made from shapes alone;
3. the family's weight table (``plan_transfers``) turned into byte moves: each split says which rows
   (and dim-1 columns) of which HF tensor each shard holds (``Split.blocks``), which, between two
   stored tensors, is a box copy (``bytemap``).

Then a pool of workers (``copier``) fills the files: contiguous boxes go file to file with
``os.copy_file_range``, the rest (row-parallel dim-1 slices, dtype changes) a band of rows at a time
through memory; replicas and tied copies are compared byte for byte. Output goes to a temporary
sibling folder that is renamed onto the target only when complete. Neither torch nor megatron-core
is imported on this path unless something needs them (a dtype change, a split or a stored layout
that cannot be described as byte ranges, or a model skeleton not yet cached).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megatron_patch.checkpoint.arch_source import open_checkpoint
from megatron_patch.checkpoint.engine import MappingError, check_hf_names, names_list, plan
from megatron_patch.checkpoint.foreign import is_training_state
from megatron_patch.checkpoint.hf_reader import HFCheckpointReader, check_hf_shapes
from megatron_patch.checkpoint.legacy import (
    CHECKPOINT_VERSION,
    FILE_NAME,
    check_legacy_layout,
    open_rank_files,
    rank_coords,
    rank_file,
)
from megatron_patch.checkpoint.outputs import TopLevelInput, atomic_output_dir, carried_files, check_target, copy_carried
from megatron_patch.checkpoint.sidecar import Sidecar
from megatron_patch.checkpoint_files.byte_io import Stored, create_file, write_all
from megatron_patch.checkpoint_files.layout import RELEASE, write_tracker
from megatron_patch.checkpoint_files.manifest import DIGEST, BackgroundCheck, digest_file, manifest_for
from megatron_patch.checkpoint_files.torch_dist import ChunkItem, TorchDistReader, plan_torch_dist
from megatron_patch.checkpoint_files.torch_files import TensorSpec, nbytes, plan_torch_save
from megatron_patch.checkpoint_files.zipfmt import ZipFormatError, ZipLayout, check_crc, seal
from megatron_patch.convert.bytemap import Move, Tiled, block_moves, box_tiles, shard_shape
from megatron_patch.convert.carried import CARRIED_TENSORS, read_carried, write_carried_plan
from megatron_patch.convert.copier import CallTask, CompareTask, Copier, CopyTask, GatherTask, cast
from megatron_patch.convert.fp8 import fp8_block_size, open_weights
from megatron_patch.convert.hf_writer import parse_size, plan_safetensors
from megatron_patch.convert.progress import Progress
from megatron_patch.convert.schedule import WHOLE_FILE
from megatron_patch.convert.stacked import StackedView, member_places, stack_entries
from megatron_patch.dtypes import PRECISION_DTYPE_NAMES, PRECISION_OF_DTYPE_NAME, dtype_name, precision_dtype_name
from megatron_patch.errors import UserError
from megatron_patch.input_files import checked_input, folder_bytes, read_json_object
from megatron_patch.lora.plan import KEY_PREFIX as LORA_KEY_PREFIX
from megatron_patch.models.description.arch import Arch, default_expert_tp, read_config_json, validate_layout
from megatron_patch.models.description.config_checks import check_weights_fit, config_dtype
from megatron_patch.models.description.registry import get_family, parse_arch
from megatron_patch.models.mapping import Transfer
from megatron_patch.models.shape.skeleton import ModelSkeleton, describe_model
from megatron_patch.runtime.distributed import ParallelLayout

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).

FORMATS = ("torch_dist", "legacy")
# Workers when none are asked for: one per core, up to 8 (the disk, not the CPU, is usually the limit).
DEFAULT_WORKERS = max(1, min(8, os.cpu_count() or 1))


def _choose_dtype(reader: HFCheckpointReader | None, names, dtype, hf_config: dict | None = None) -> str:
    """The dtype name the output is written in: ``dtype`` (a precision name or torch dtype), or the
    source's own when it is one of the precisions, else (a quantized hub folder: FP8 weights beside bf16 ones,
    MXFP4 experts) the float dtype its config.json names, which is what its weights dequantize to."""
    if dtype is not None:
        name = dtype_name(dtype)
        if name not in PRECISION_OF_DTYPE_NAME:
            name = precision_dtype_name(name)  # "bf16" -> "bfloat16", or UserError
        return name
    found = {reader.dtype(n) for n in names}
    if len(found) == 1 and next(iter(found)) in PRECISION_OF_DTYPE_NAME:
        return next(iter(found))
    named = config_dtype(hf_config or {})
    if named in PRECISION_OF_DTYPE_NAME:
        print(f"hf2mcore: the HF tensors are stored as {sorted(found)}: writing {named}, the dtype config.json names "
              "(--dtype chooses another)", file=sys.stderr, flush=True)
        return named
    raise UserError(f"the HF tensors are stored as {sorted(found)} and config.json names no float dtype they share: "
                    "pass --dtype bf16, fp16 or fp32")


def _make_copier(copier: Copier | None, workers: int | None) -> Copier:
    return Copier(DEFAULT_WORKERS if workers is None else workers) if copier is None else copier


def _copy_with_progress(copier: Copier, tasks: list, desc: str, total_bytes: int, tensors: int, progress) -> Progress:
    """Run ``tasks`` on ``copier`` (its workers end, whatever happens) under a progress bar of ``tensors`` tensors
    and ``total_bytes`` bytes (``progress``: as ``Progress``'s ``enabled``). The caller closes the bar, with the
    copier's stats, once the output is published."""
    bar = Progress(desc, total_bytes, tensors, progress)
    copier.progress = bar
    try:
        copier.run(tasks)
    finally:
        copier.close()
    bar.update(0, tensors=tensors)
    return bar


def _move_tasks(copier: Copier, moves: list[Move], what: str = "a tensor") -> list:
    """Copy tasks when every move is one contiguous range on both sides, else gather tasks for all of
    them (a gather writes whole rows of its outputs, so no other task may write there); ``what``: the
    tensor moved, for messages."""
    if not moves:
        return []
    if all(m.contiguous for m in moves):
        return [task for m in moves for task in copier.copy_tasks(m.src.path, m.src_range[0], m.dst.path,
                                                                   m.dst_range[0], m.src_range[1])]
    return copier.gather_tasks(moves, what)


def _write_tensor(copier: Copier, dst: Stored, tensor, what: str) -> int:
    """A torch tensor (``what``, for messages) into its place (the paths the byte plan cannot express)."""
    import torch

    data = cast(tensor.detach(), dst.dtype, what).contiguous().reshape(-1)
    if tuple(tensor.shape) != tuple(dst.shape):
        raise MappingError(f"internal error: a tensor of shape {tuple(tensor.shape)} for a place of shape {dst.shape}")
    if data.numel():
        write_all(copier.fd(dst.path, True), data.view(torch.uint8).numpy(), dst.offset)
    return data.numel() * data.element_size()


def _label(t: Transfer) -> str:
    """The tensor a transfer moves, for messages: its HF name, or the MCore name of several fused."""
    return t.hf_names[0] if len(t.hf_names) == 1 else t.placements[0].mcore_name


def _check_floating(dtype: str, what: str) -> None:
    """A weight stored as integers or booleans would be cast by value into the float checkpoint: refused."""
    if not dtype.startswith(("float", "bfloat")):
        raise UserError(f"{what} is stored as {dtype}, not a floating-point dtype: a weight cannot be converted from "
                        "it (the file is damaged or holds something else)")


def _restrict(moves: list[Move], region: tuple[slice, ...], target: Stored) -> list[Move] | None:
    """The moves into a full parameter, cut to the part of it a stored chunk holds (``region``: slices
    of the parameter's dims), landing in ``target`` (that chunk). None if the region is not a box of
    the parameter's 2-D view (it splits a dim past the second)."""
    if not moves:
        return []
    full = moves[0].dst
    shape = full.shape
    if any((s.start, s.stop) != (0, n) for s, n in zip(region[2:], shape[2:])):
        return None
    r0, r1 = (region[0].start, region[0].stop) if region else (0, 1)
    c0, c1 = (region[1].start * full.inner, region[1].stop * full.inner) if len(region) > 1 else (0, full.cols)
    out = []
    for m in moves:
        i0, i1 = max(r0, m.dst_row), min(r1, m.dst_row + m.rows)
        j0, j1 = max(c0, m.dst_col), min(c1, m.dst_col + m.cols)
        if i0 < i1 and j0 < j1:
            out.append(Move(m.src, m.src_row + i0 - m.dst_row, m.src_col + j0 - m.dst_col, target,
                            i0 - r0, j0 - c0, i1 - i0, j1 - j0))
    return out


# --- HF -> MCore -------------------------------------------------------------------------------

def hf_to_mcore(hf_dir: str | Path, save_dir: str | Path, layout: ParallelLayout, fmt: str = "torch_dist",
                dtype=None, force: bool = False, progress: bool | None = None, mtp: bool | str = False,
                workers: int | None = None, copier: Copier | None = None, adapter=None) -> Sidecar:
    """Convert an HF model folder into an MCore checkpoint folder (``fmt``: torch_dist or legacy).

    ``workers``: threads that copy bytes (default ``DEFAULT_WORKERS``); ``copier``: a configured
    ``Copier`` instead (tests: tracing, the fallback path). ``dtype``: bf16 / fp16 / fp32 (or a torch
    dtype); None keeps the HF tensors' own.

    FP8 block-scaled weights and MXFP4 experts are dequantized on the way (``convert.fp8``,
    ``convert.mxfp4``; through torch, as they are computed, not copied). Multi-token-prediction layers go into megatron-core's MTP block with
    ``mtp`` (True: refused if config.json declares none; "auto": those it declares, if any); without it they are
    dropped, with a count printed and a note in the sidecar.

    ``adapter``: LoRA adapters to store beside the weights (``convert.lora_io.PeftImport``: their tensors
    under layout-free keys, modules_to_save weights that replace the base's, the sidecar's ``lora``).
    """
    if adapter is not None and fmt != "torch_dist":
        raise UserError("--peft-dir writes the adapters beside the weights in torch_dist, which loads at any layout: "
                        "use --format torch_dist")
    if fmt not in FORMATS:
        raise UserError(f"unknown checkpoint format {fmt!r}: choose {' or '.join(FORMATS)}")
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise UserError(f"{hf_dir} is not a folder: point --hf-dir at a Hugging Face model folder")
    arch = parse_arch(hf_dir)
    family = get_family(arch.family)
    layout, note = default_expert_tp(arch, layout)
    if note:
        print(f"hf2mcore: {note}", file=sys.stderr, flush=True)
    # once, before anything slow: the plans below take it as checked
    validate_layout(arch, layout, uneven_pipelines=False)
    if fmt == "legacy":
        check_legacy_layout(layout)
    inputs = (TopLevelInput(hf_dir),)  # only its top-level files are read: the output may be a folder inside it
    check_target(save_dir, force, inputs=inputs, writer="mpatch convert")  # fail before the slow part (checked again under the lock)
    side_files = carried_files(hf_dir)
    for name in side_files:  # each inside the folder and a regular file, before the slow part
        checked_input(hf_dir / name, inside=hf_dir, how="has a side file", limit=None)
    hf_reader = HFCheckpointReader(hf_dir)
    check_weights_fit(arch, sum(hf_reader.nbytes(n) for n in hf_reader.keys()), f"the safetensors of {hf_dir}")
    reader = open_weights(family.hf_reader(hf_reader), arch.hf_config)
    if adapter is not None and adapter.saved:
        reader = adapter.reader(reader)
    notes = []
    if hasattr(reader, "note"):  # dequantized (FP8, MXFP4): the checkpoint and its export hold plain weights
        notes.append(reader.note)
        arch = dataclasses.replace(arch, hf_config={k: v for k, v in arch.hf_config.items() if k != "quantization_config"})
    available, arch = _multi_token_prediction(family, arch, reader, mtp, notes)
    tp1 = plan(family, arch, ParallelLayout())
    check_hf_names(family, arch, tp1, available)
    reader = StackedView(reader, family.hf_stacked(arch))  # stacked experts read as the table's members
    # Tensors with a dtype of their own (Rule.dtype: an integer table, say) do not decide the checkpoint's.
    weights = [n for t in tp1 if t.dtype is None for n in t.hf_names]
    for n in (n for t in tp1 if t.floating for n in t.hf_names):
        place = reader.stored(n)  # None: dequantized (float32)
        _check_floating(reader.dtype(n), f"{n} in {place.path}" if place is not None else n)
    out_dtype = _choose_dtype(reader, weights, dtype, arch.hf_config)
    skeleton = describe_model(arch)
    check_hf_shapes(reader, skeleton.hf_shapes)

    transfers = tp1 if fmt == "torch_dist" else plan(family, arch, layout, checked=True)
    # tensors kept in the dtype they are stored in (an integer table) take the HF file's
    transfers = [t.as_stored(lambda t: reader.dtype(t.hf_names[0])) for t in transfers]
    carried = _carried_sources(family, arch, reader, available, notes, out_dtype)
    copier = _make_copier(copier, workers)
    digested: dict = {}
    with atomic_output_dir(save_dir, force, tool="mpatch convert hf2mcore", inputs=inputs, digested=digested) as tmp:
        release = tmp / RELEASE
        release.mkdir()
        tasks = _copy_checks(family, arch, reader, available)
        # tensors carried byte for byte beside the checkpoint's weights
        carried_tasks = _carried_tasks(copier, reader, carried, write_carried_plan(tmp, carried)) if carried else []
        if fmt == "legacy":
            out_tasks, count, total, finish = _plan_legacy(release, arch, layout, transfers, reader, out_dtype, copier)
        else:
            out_tasks, count, total, finish = _plan_torch_dist(release, arch, transfers, reader, out_dtype, skeleton, copier,
                                                               adapter.tensors if adapter is not None else None)
        tasks += carried_tasks + out_tasks + _digest_tasks(tmp, carried_tasks + out_tasks, digested)
        bar = _copy_with_progress(copier, tasks, f"hf2mcore {fmt} {layout}", total, count, progress)
        finish()
        kept = copy_carried(hf_dir, tmp, side_files) + ([CARRIED_TENSORS] if carried else [])
        sidecar = Sidecar.create(fmt, arch, layout, out_dtype, carried_files=kept,
                                 num_tensors=count, num_bytes=total, source=str(hf_dir.resolve()), notes=notes,
                                 lora=adapter.sidecar if adapter is not None else None)
        sidecar.write(tmp)
        # Written last: Megatron treats a folder with this file as a finished checkpoint.
        write_tracker(tmp, RELEASE)
    bar.close(copier.stats)
    return sidecar


def dequantize_hf(hf_dir: str | Path, save_dir: str | Path, dtype: str = "bf16", force: bool = False,
                  max_shard_size: str | int = "5GB", workers: int | None = None) -> Path:
    """A block-scaled FP8 hub folder (DeepSeek-V3's) written again as a plain HF folder (what Pai-Megatron-Patch's
    fp8_cast_bf16.py makes before its converter): each FP8 weight dequantized as hf2mcore dequantizes it (the
    float32 product, cast to ``dtype``: transformers' own values), every other tensor as stored, config.json
    without its quantization_config, the tokenizer and generation files carried. hf2mcore reads the FP8 folder
    itself, so a conversion does not need this step."""
    import torch

    hf_dir = Path(hf_dir)
    raw = read_config_json(hf_dir)
    reader = HFCheckpointReader(hf_dir)
    weights = open_weights(reader, raw)
    if fp8_block_size(raw) is None:
        raise UserError(f"{hf_dir}'s config.json declares no block-scaled FP8 weights (quantization_config "
                        "quant_method fp8): there is nothing to dequantize, convert it as it is")
    out_dtype = PRECISION_DTYPE_NAMES[dtype]
    entries = [(n, weights.shape(n), out_dtype if weights.stored(n) is None else weights.dtype(n))
               for n in sorted(weights.keys())]
    inputs = (TopLevelInput(hf_dir),)
    check_target(save_dir, force, inputs=inputs, writer="mpatch convert")
    with atomic_output_dir(save_dir, force, tool="mpatch convert pai fp8_cast_bf16.py", inputs=inputs) as tmp:
        plan = plan_safetensors(tmp, entries, parse_size(max_shard_size))
        plan.write_headers()

        def write(entry) -> None:  # one tensor in memory per worker
            name, _, name_of_dtype = entry
            place = plan.stored[name]
            data = cast(weights.get(name), name_of_dtype, name).contiguous().reshape(-1)
            fd = os.open(place.path, os.O_WRONLY)
            try:
                write_all(fd, data.view(torch.uint8).numpy(), place.offset)
            finally:
                os.close(fd)

        with ThreadPoolExecutor(DEFAULT_WORKERS if workers is None else workers) as pool:
            list(pool.map(write, entries))
        _write_hf_config(tmp, {k: v for k, v in raw.items() if k != "quantization_config"}, out_dtype)
        copy_carried(hf_dir, tmp)
    return Path(save_dir)


def _carried_sources(family, arch: Arch, reader, available: set[str], notes: list[str],
                     out_dtype: str) -> dict[str, Stored]:
    """The HF tensors the family carries beside the MCore model, where their bytes are; said once, loudly. A
    family's multi-token-prediction layers kept but not built (``hf_mtp_carried``) are among them; a dequantized
    one of those (its place None) is written in ``out_dtype``, as the model's weights are."""
    mtp = family.hf_mtp_names(arch, available) if family.hf_mtp_carried else set()
    names = sorted(n for n in available if family.is_carried(n) or n in mtp)
    if not names:
        return {}
    sources = {n: reader.stored(n) for n in names}
    computed = [n for n, place in sources.items() if place is None]
    if any(n not in mtp for n in computed):
        raise UserError(f"{computed[0]} is quantized: tensors carried beside the model are copied as stored")
    sources.update({n: Stored("", 0, tuple(reader.shape(n)), out_dtype) for n in computed})
    if mtp:
        note = (f"{len(mtp)} tensors of {family.hf_mtp_layers(arch.hf_config)} multi-token-prediction layer(s) "
                f"travel beside the MCore model in {CARRIED_TENSORS}{' (dequantized)' if computed else ', unchanged'}, "
                "are written back on export and are not built or trained")
        print(f"hf2mcore: {note}", file=sys.stderr, flush=True)
        notes.append(note)
    if len(names) > len(mtp):
        others = [n for n in names if n not in mtp]
        note = (f"the MCore model holds the language model only: {len(others)} other tensors ({others[0]}, ...) "
                f"travel beside it unchanged in {CARRIED_TENSORS}, are written back on export and are not trained")
        print(f"hf2mcore: {note}", file=sys.stderr, flush=True)
        notes.append(note)
    return sources


def _carried_tasks(copier: Copier, reader, sources: dict[str, Stored], places: dict[str, Stored]) -> list:
    """Copies of the carried tensors into their places: bytes where they are stored, through torch where they are
    computed (dequantized: their source has no path)."""
    computed = [n for n, src in sources.items() if not src.path]
    tasks = _move_tasks(copier, _whole_moves({n: s for n, s in sources.items() if s.path}, places))
    return tasks + [CallTask(lambda copier, n=n: _write_tensor(copier, places[n], reader.get(n), n),
                             writes=(places[n].path,)) for n in computed]


def _whole_moves(sources: dict[str, Stored], places: dict[str, Stored]) -> list[Move]:
    """Each source tensor's bytes, whole, into its place."""
    return [Move(src, 0, 0, places[n], 0, 0, src.rows, src.cols) for n, src in sources.items() if src.nbytes]


def _multi_token_prediction(family, arch: Arch, reader, keep: bool | str, notes: list[str]) -> tuple[set[str], Arch]:
    """(the HF tensors to convert, the model to build): with ``keep`` ("auto": where config.json declares some), the
    MTP layers join the model; without, their tensors are left out, loudly."""
    names, count = set(reader.keys()), family.hf_mtp_layers(arch.hf_config)
    asked = keep is True
    if keep == "auto":
        keep = count > 0
    if keep:
        if not count:
            raise UserError("--mtp: this checkpoint's config.json declares no multi-token-prediction layers")
        if family.hf_mtp_carried:  # kept beside the model (_carried_sources), not built into it
            if asked and not family.hf_mtp_names(arch, names):
                raise UserError(f"--mtp: config.json declares {count} multi-token-prediction layer(s) but the checkpoint "
                                "holds none of their tensors (transformers' save_pretrained does not write them)")
            return names, arch
        return names, dataclasses.replace(arch, mtp_layers=count)
    dropped = family.hf_mtp_names(arch, names)
    if dropped:
        note = (f"{len(dropped)} tensors of {count} multi-token-prediction layer(s) were not converted "
                "(convert with --mtp to keep them)")
        print(f"hf2mcore: {note}", file=sys.stderr, flush=True)
        notes.append(note)
    return names - dropped, arch


def _copy_checks(family, arch: Arch, reader, available: set[str]) -> list:
    """The checks of ``engine.check_tied_copies`` as tasks: a tied checkpoint may still store the copy
    (lm_head), and an MTP layer stores copies of the embedding and head; each must equal what it
    copies. Compared byte for byte where both are stored alike, else through torch."""
    pairs = [(name, source, f"config.json ties the embeddings but {name} differs from {source}: "
              "set tie_word_embeddings=false") for name, source in family.tied_hf_names(arch).items()]
    pairs += [(name, source, f"{name} differs from {source}, which megatron-core shares with it: the checkpoint "
               "cannot be represented") for name, source in family.hf_copies(arch).items()]
    tasks = []
    for name, source, message in pairs:
        if name not in available:
            continue
        a, b = reader.stored(name), reader.stored(source)
        if a is not None and b is not None and a.dtype == b.dtype:
            tasks.append(CompareTask(a, b, message))
            continue

        def compare(_copier, name=name, source=source, message=message) -> int:
            import torch

            if not torch.equal(reader.get(name), reader.get(source)):
                raise MappingError(message)
            return 0

        tasks.append(CallTask(compare, writes=()))
    return tasks


def _hf_to_shards(t: Transfer, reader: HFCheckpointReader) -> tuple[list | None, list[tuple[int, ...]]]:
    """(blocks per shard or None, shard shapes) of transfer ``t`` from the HF tensors' shapes."""
    shapes = [reader.shape(n) for n in t.hf_names]
    blocks = t.split.blocks(shapes, t.num_shards, t.context)
    if blocks is not None:
        return blocks, [shard_shape(b, shapes) for b in blocks]
    import torch

    meta = [torch.empty(s, device="meta") for s in shapes]
    return None, [tuple(s.shape) for s in t.split.shards(meta, t.num_shards, t.context)]


def _transfer_tasks(copier: Copier, t: Transfer, blocks, reader: HFCheckpointReader,
                    destinations: dict[int, list[Stored]]) -> list:
    """Tasks that write every shard of ``t`` into its places (``destinations``: shard -> places)."""
    parts = [reader.stored(n) for n in t.hf_names]
    if blocks is not None and None not in parts:  # None: computed, not stored (FP8 dequantized)
        moves = [m for shard, places in destinations.items() for place in places
                 for m in block_moves(blocks[shard], parts, place)]
        return _move_tasks(copier, moves, _label(t))

    def run(copier: Copier) -> int:  # a split that is not rows and columns: through torch
        shards = t.split.shards([reader.get(n) for n in t.hf_names], t.num_shards, t.context)
        return sum(_write_tensor(copier, place, shards[shard], _label(t)) for shard, places in destinations.items()
                   for place in places)

    return [CallTask(run, writes=tuple({place.path for places in destinations.values() for place in places}))]


def _plan_legacy(release: Path, arch: Arch, layout: ParallelLayout, transfers: list[Transfer], reader: HFCheckpointReader,
                 dtype: str, copier: Copier):
    coords = rank_coords(layout)
    specs: dict = {c: {} for c in coords}
    shapes_of, blocks_of = [], []
    for t in transfers:
        blocks, shapes = _hf_to_shards(t, reader)
        blocks_of.append(blocks)
        shapes_of.append(shapes)
        for p in t.placements:
            for c in coords:
                if c.holds(t, p):
                    specs[c][p.mcore_name] = TensorSpec(shapes[p.shard], t.dtype_in(dtype))
    files, places = [], {}
    for c in coords:
        path = rank_file(release, c, layout)
        path.parent.mkdir(parents=True)
        zl, stored = plan_torch_save(path, {"model": specs[c], "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0},
                                     archive=Path(FILE_NAME).stem)
        files.append((path, zl))
        for (_, name), s in stored.items():
            places[(c, name)] = s
    for path, zl in files:  # each file at its full size, headers and pickle in place
        create_file(path, zl.size, zl.small)
    tasks, count, total = [], 0, 0
    for t, blocks in zip(transfers, blocks_of):
        destinations: dict[int, list[Stored]] = defaultdict(list)
        for p in t.placements:
            for c in coords:
                if c.holds(t, p):
                    destinations[p.shard].append(places[(c, p.mcore_name)])
                    count += 1
                    total += places[(c, p.mcore_name)].nbytes
        tasks += _transfer_tasks(copier, t, blocks, reader, destinations)
    return tasks + _seal_tasks(files), count, total, lambda: None


def _plan_torch_dist(release: Path, arch: Arch, transfers: list[Transfer], reader: HFCheckpointReader, dtype: str,
                     skeleton: ModelSkeleton, copier: Copier, extra: dict | None = None):
    """``extra``: whole tensors (by key, in their own dtype) stored beside the model's (LoRA adapters)."""
    by_name = {t.placements[0].mcore_name: t for t in transfers}
    chunks = defaultdict(list)
    for ch in skeleton.chunks:
        if ch.name not in by_name:
            raise MappingError(f"the model's sharded state dict has {ch.name}, which no mapping rule writes")
        chunks[ch.name].append(ch)
    items = [ChunkItem(ch.key, ch.global_shape, ch.global_offset, ch.local_shape, t.dtype_in(dtype))
             for name, t in by_name.items() for ch in chunks[name]]
    extra = extra or {}
    items += [ChunkItem(k, tuple(v.shape), (0,) * v.dim(), tuple(v.shape), dtype_name(v.dtype)) for k, v in extra.items()]
    td = plan_torch_dist(release, items, [(o.unique_key, o.payload) for o in skeleton.objects])
    td.create_files()
    tasks = []
    for name, t in by_name.items():
        blocks, (shape,) = _hf_to_shards(t, reader)
        targets = [(ch, td.stored[(ch.key, tuple(ch.global_offset))]) for ch in chunks[name]]
        parts = [reader.stored(n) for n in t.hf_names]
        if blocks is not None and None not in parts:  # None: computed, not stored (FP8 dequantized)
            full = Stored("", 0, tuple(shape), t.dtype_in(dtype))
            moves = block_moves(blocks[0], parts, full)
            pieces = []
            for ch, place in targets:
                region = ch.region()
                target = Stored(place.path, place.offset, tuple(s.stop - s.start for s in region), full.dtype)
                cut = _restrict(moves, region, target)
                if cut is None:
                    break
                pieces.append(cut)
            else:
                tasks += _move_tasks(copier, [m for cut in pieces for m in cut], _label(t))
                continue

        def run(copier: Copier, t=t, targets=targets) -> int:  # through torch
            full = t.split.shards([reader.get(n) for n in t.hf_names], 1, t.context)[0]
            return sum(_write_tensor(copier, place, full[ch.region()].reshape(place.shape), _label(t))
                       for ch, place in targets)

        tasks.append(CallTask(run, writes=tuple({place.path for _, place in targets})))
    tasks += [CallTask(lambda copier, k=k, v=v: _write_tensor(copier, td.stored[(k, (0,) * v.dim())], v, k),
                       writes=(td.stored[(k, (0,) * v.dim())].path,)) for k, v in extra.items()]
    total = sum(nbytes(ch.local_shape, by_name[ch.name].dtype_in(dtype)) for ch in skeleton.chunks)
    tasks += _seal_tasks([(release / name, layout) for name, layout in td.archives])
    return tasks, len(skeleton.chunks) + len(extra), total, td.finish


def _seal_tasks(archives: list[tuple[Path, ZipLayout]]) -> list:
    """Every zip record copied in gets its real CRC-32, computed from the page cache by the copier's workers
    (about 12 GB/s per core) as soon as all of its bytes are in place, beside the copies still running."""
    def run(_copier, path, layout, name) -> int:
        fd = os.open(path, os.O_RDWR)
        try:
            seal(fd, layout, [name])
        finally:
            os.close(fd)
        return 0

    tasks = []
    for path, layout in archives:
        for name in layout.unsealed:
            offset, length = layout.records[name]
            tasks.append(CallTask(functools.partial(run, path=str(path), layout=layout, name=name), writes=(),
                                  reads=(str(path), offset), after=((str(path), offset, offset + length),),
                                  patches=tuple((str(path), at, at + 4) for at in layout.unsealed[name])))
    return tasks


def _digest_tasks(folder: Path, tasks: list, digested: dict) -> list:
    """The manifest's digest of each file the ``tasks`` write, taken by a copier worker as soon as every task
    writing in that file is done (beside the copies into the other files), into ``digested``."""
    paths = set()
    for t in tasks:
        if isinstance(t, CopyTask):
            paths.add(t.dst)
        elif isinstance(t, GatherTask):
            paths.update(m.dst.path for m in t.moves)
        elif isinstance(t, CallTask):  # one whose writes are not known is waited for, its files hashed later
            paths.update(t.writes or ())
            paths.update(p for p, _, _ in t.patches)

    def run(_copier, path: str) -> int:
        size, digest = digest_file(path)
        digested[Path(path).relative_to(folder).as_posix()] = {"size": size, DIGEST: digest}
        return 0

    return [CallTask(functools.partial(run, path=p), writes=(), reads=(p, 0), after=((p, 0, WHOLE_FILE),))
            for p in sorted(paths)]


# --- MCore -> HF -------------------------------------------------------------------------------

def mcore_to_hf(load_dir: str | Path, save_dir: str | Path, dtype=None, max_shard_size: str | int = "5GB",
                force: bool = False, progress: bool | None = None, hf_config: str | Path | None = None,
                family: str | None = None, iteration: int | None = None, workers: int | None = None,
                copier: Copier | None = None, verify: bool = True, base_only: bool = False) -> Path:
    """Convert a Megatron-Core checkpoint into an HF model folder.

    ``load_dir`` is any torch_dist or legacy checkpoint (its root, or one iteration or release folder):
    one written here (hf2mcore, a training run or its final export: the sidecar says everything) or
    by another tool, whose architecture comes from ``hf_config`` or from its saved Megatron-LM
    arguments read as ``family`` (``checkpoint.arch_source``). Optimizer state is skipped; ``iteration`` picks
    an older iteration than the tracker's. ``workers`` / ``copier``: as for ``hf_to_mcore``. ``verify``: check
    the input against its manifest where it has one (beside the copy, before the output is published).

    A checkpoint that holds LoRA adapters exports through ``convert.lora_io`` (--lora-adapter, --merge-lora);
    ``base_only`` exports the base weights a checkpoint carries beside its adapters (hf2mcore --peft-dir)."""
    # Every folder read is an input the output may not overlap: the one given, the weights' folder, the
    # sidecar's, and the folder --hf-config came from.
    config_folder = _config_folder(hf_config)
    inputs = (load_dir, None if config_folder is None else TopLevelInput(config_folder))
    check_target(save_dir, force, inputs=inputs, writer="mpatch convert")
    opened = open_checkpoint(load_dir, hf_config=hf_config, family=family, iteration=iteration, verify=verify)
    for note in opened.found.notes + opened.notes:
        print(f"warning: {note}", file=sys.stderr, flush=True)
    lora = opened.sidecar.lora
    if lora and not base_only:
        raise UserError(f"{opened.sidecar_dir} holds LoRA adapters: pass --lora-adapter (a peft adapter folder) or "
                        "--merge-lora (the model with the adapters merged in)")
    if lora and lora.get("base"):
        raise UserError(f"{opened.sidecar_dir} holds LoRA adapters only; its base model is {lora['base']['path']}")
    inputs += (opened.sidecar_dir, opened.found.folder)
    manifest = manifest_for(opened.found.folder) if verify else None
    check = BackgroundCheck(manifest) if manifest is not None else None
    try:
        _export_hf(opened, save_dir, dtype, max_shard_size, force, progress, copier, workers, inputs, check,
                   config_folder)
    except Exception as exc:
        # A damaged input file explains a failed conversion better than the conversion's own error.
        found = check.failure() if check is not None else None
        if found is not None and found is not exc:
            raise found from None
        raise
    return Path(save_dir)


def _export_hf(opened, save_dir, dtype, max_shard_size, force: bool, progress, copier, workers, inputs: tuple,
               check: BackgroundCheck | None, config_folder: Path | None = None) -> None:
    load_dir, data_dir, sidecar = opened.sidecar_dir, opened.found.folder, opened.sidecar
    arch = sidecar.arch
    if (arch.vocab_size, arch.padded_vocab_size()) != (sidecar.vocab_size, sidecar.padded_vocab_size):
        raise UserError(f"the sidecar's vocabulary ({sidecar.vocab_size}, padded {sidecar.padded_vocab_size}) "
                        f"disagrees with its config ({arch.vocab_size}, padded {arch.padded_vocab_size()})")
    check_weights_fit(arch, folder_bytes(data_dir), f"{data_dir}")
    family = get_family(arch.family)
    out_dtype = sidecar.dtype_name if dtype is None else _choose_dtype(None, [], dtype)
    max_bytes = parse_size(max_shard_size)
    check_target(save_dir, force, inputs=inputs, writer="mpatch convert")
    skeleton = describe_model(arch)
    tp1 = plan(family, arch, ParallelLayout())
    hf_shapes = skeleton.hf_shapes
    if sidecar.checkpoint_format == "legacy":
        layout = sidecar.parallel_layout
        check_legacy_layout(layout)
        transfers = plan(family, arch, layout)  # which checks the layout against the model
        source = _LegacySource(data_dir, arch, layout, transfers, hf_shapes)
    else:
        transfers = tp1
        adapters = (LORA_KEY_PREFIX,) if sidecar.lora else ()  # stored beside the base weights (--peft-dir)
        weights = {t.placements[0].mcore_name for t in transfers if t.floating}
        source = _TorchDistSource(data_dir, skeleton, weights,
                                  ignore=lambda k: is_training_state(k) or k.startswith(adapters))
    # tensors kept in the dtype they are stored in (an integer table) are written back in the MCore checkpoint's
    transfers = [t.as_stored(lambda t: source.shards(t)[0].dtype) for t in transfers]
    entries, made_by = [], {}
    for t in transfers:
        for n in t.hf_names:
            if n not in made_by:
                made_by[n] = t
                entries.append((n, hf_shapes[n], t.dtype_in(out_dtype)))
    # HF tensors that repeat others (an MTP layer's embedding and head): the same bytes, written twice.
    copies = family.hf_copies(arch)
    entries += [(copy, hf_shapes[src], made_by[src].dtype_in(out_dtype)) for copy, src in copies.items()]
    entries = stack_entries(entries, family.hf_stacked(arch))
    # HF tensors carried beside the model (convert/carried.py), back among the exported ones as they were
    carried = read_carried(load_dir) if CARRIED_TENSORS in sidecar.carried_files else {}
    _check_carried(carried, family, arch, {n for n, _, _ in entries}, load_dir)
    entries += [(n, place.shape, place.dtype) for n, place in carried.items()]
    copier = _make_copier(copier, workers)
    total = sum(nbytes(s, d) for _, s, d in entries)
    digested: dict = {}
    with atomic_output_dir(save_dir, force, tool="mpatch convert mcore2hf", inputs=inputs, digested=digested) as tmp:
        out = plan_safetensors(tmp, entries, max_bytes)
        out.write_headers()
        places = member_places(out.stored, family.hf_stacked(arch))
        tasks = _plan_mcore_to_hf(arch, transfers, source, places, copies, copier)
        tasks += _move_tasks(copier, _whole_moves(carried, places))
        tasks += _digest_tasks(tmp, tasks, digested)
        # The stored CRC-32s, checked beside the copies that read them; a file the manifest check reads whole
        # (every file of a checkpoint written here) is checked by its digest instead.
        tasks = crc_tasks(source.crc_checks(), skip=check.files if check is not None else ()) + tasks
        try:
            bar = _copy_with_progress(copier, tasks, f"mcore2hf {sidecar.checkpoint_format}", total, len(entries),
                                      progress)
        finally:
            source.close()
        source.check_all_read()
        _write_hf_config(tmp, sidecar.hf_config, out_dtype)
        files_from = _carry_side_files(load_dir, [f for f in sidecar.carried_files if f != CARRIED_TENSORS],
                                       config_folder, tmp)
        if sidecar.tokenizer_model_config is not None:  # a training run's MP_TOKENIZER, read with another config
            _name_what_the_run_read(load_dir, tmp, files_from)
        if check is not None:
            check.result()  # what was read is what was written: the output may be published
    bar.close(copier.stats)


def _check_carried(carried: dict, family, arch: Arch, exported: set[str], load_dir) -> None:
    """Each carried tensor one the family carries (``_carried_sources``: its carried modules, and its MTP layers kept
    unbuilt) and the model does not export itself: one that names a tensor of the model (a hand edit, another tool's
    file) was written twice under one name, a safetensors file no reader opens, published with exit 0 (the
    converter audit)."""
    mtp = family.hf_mtp_names(arch, set(carried)) if family.hf_mtp_carried else set()
    for name in carried:
        if name in exported or not (family.is_carried(name) or name in mtp):
            why = "a tensor of the model itself" if name in exported else f"not one the {family.name} family carries"
            raise UserError(f"{Path(load_dir) / CARRIED_TENSORS} holds {name[:120]!r}, {why}: the file is not this "
                            "checkpoint's; restore it from the conversion that wrote it, or convert again")


def _carry_side_files(load_dir: Path, listed: list[str], config_folder: Path | None, out: Path) -> Path | None:
    """The tokenizer and generation files into the export: those the checkpoint carries, else (a checkpoint of
    another tool, or an iteration saved before runs carried them) those of the HF folder --hf-config names.
    Returns the folder they came from."""
    if listed:
        copy_carried(load_dir, out, listed)
        return load_dir
    found = carried_files(config_folder) if config_folder is not None else []
    if found:
        copy_carried(config_folder, out, found)
        print(f"mcore2hf: the checkpoint carries no tokenizer files: {len(found)} taken from {config_folder} "
              f"({', '.join(found[:3])}{', ...' if len(found) > 3 else ''})", file=sys.stderr, flush=True)
        return config_folder
    print("warning: the export has no tokenizer files, as the checkpoint carries none: --hf-config HF_DIR takes them "
          "from the model's HF folder", file=sys.stderr, flush=True)
    return None


def _name_what_the_run_read(load_dir: Path, out: Path, files_from: Path | None) -> None:
    """The export's config.json picks transformers' tokenizer class where tokenizer_config.json names none; a
    training run read its MP_TOKENIZER folder with another model config, or none (its files alone), and built
    another pipeline (other ids for the same text): the export's tokenizer_config.json names the class the run
    read it as, so transformers builds that pipeline from the export too. Where it names no eos_token, it names the
    end-of-document token the run found and trained (a folder of tokenizer.json alone: transformers' tokenizer of
    the export had none, and lm-eval's HF backend failed on it)."""
    config_file = out / "tokenizer_config.json"
    if not (config_file.is_file() or (out / "tokenizer.json").is_file()):
        return
    # a tokenizer folder of tokenizer.json alone gets a tokenizer_config.json of these entries
    # read where it was copied from (the message names that file; the export is still a partial folder)
    config = read_json_object(files_from / config_file.name, inside=files_from) if config_file.is_file() else {}
    # transformers: only for a checkpoint whose tokenizer was read with another config than its own
    from megatron_patch.tokenizer import HFTokenizer, load_hf_tokenizer, load_tokenizer

    named = {}
    if not config.get("tokenizer_class"):
        read_as, built = type(load_hf_tokenizer(load_dir)).__name__, type(load_hf_tokenizer(out)).__name__
        if read_as != built:
            # transformers 5's name for the class a tokenizer.json alone gives; 4.x knows it by its older name
            named["tokenizer_class"] = "PreTrainedTokenizerFast" if read_as == "TokenizersBackend" else read_as
            why = f"the class the training run read its tokenizer as (config.json alone would pick {built}: other ids)"
    run_tokenizer = load_tokenizer(load_dir)
    if not config.get("eos_token") and isinstance(run_tokenizer, HFTokenizer):
        named["eos_token"] = run_tokenizer.eod_token
    if not named:
        return
    config_file.write_text(json.dumps({**config, **named}, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if "tokenizer_class" in named:
        print(f"mcore2hf: the export's tokenizer_config.json names tokenizer_class {named['tokenizer_class']}, {why}",
              file=sys.stderr, flush=True)
    if "eos_token" in named:
        print(f"mcore2hf: the export's tokenizer_config.json names eos_token {named['eos_token']!r}, the "
              "end-of-document token the training run found (it named none)", file=sys.stderr, flush=True)


def _config_folder(hf_config) -> Path | None:
    """The folder an ``--hf-config`` was read from (None for a dict or nothing)."""
    if hf_config is None or isinstance(hf_config, dict):
        return None
    path = Path(hf_config)
    return path if path.is_dir() else path.parent


def _plan_mcore_to_hf(arch: Arch, transfers: list[Transfer], source, places: dict[str, Stored],
                      copies: dict[str, str], copier: Copier) -> list:
    """Moves from the shards of every transfer into the HF tensors' places; replicas and the last
    stage's copy of a tied embedding are compared with the copy that is written. An HF tensor that
    ``copies`` another (copy -> source) gets the same moves as its source."""
    copy_places: dict[Stored, list[Stored]] = defaultdict(list)   # a source's place -> its copies' places
    for copy, src in copies.items():
        copy_places[places[src]].append(places[copy])
    first: dict[str, tuple[Transfer, list]] = {}   # HF name -> the transfer that writes it, its shards
    tasks = []
    for t in transfers:
        shards = source.shards(t)
        tasks += source.copy_checks(t)
        again = len(t.hf_names) == 1 and t.hf_names[0] in first
        if again:  # the last stage's own copy of a tied embedding
            message = ("the last stage's output layer differs from the tied embedding: the checkpoint was changed "
                       "in a way HF cannot represent (untie the embeddings in config.json)")
            tasks += _compare_shards(first[t.hf_names[0]], (t, shards), message, source)
            continue
        for n in t.hf_names:
            first[n] = (t, shards)
        parts = [places[n] for n in t.hf_names]
        blocks = t.split.blocks([p.shape for p in parts], t.num_shards, t.context)
        if blocks is None or any(s is None for s in shards):  # a strided legacy tensor, or a split not by rows
            tasks.append(CallTask(lambda copier, t=t, parts=parts: _merge_through_torch(copier, t, source, parts,
                                                                                       copy_places),
                                  writes=tuple({p.path for part in parts for p in [part, *copy_places.get(part, ())]})))
            continue
        moves, written = [], {}
        for k, shard in enumerate(shards):
            shard_moves = block_moves(blocks[k], parts, shard.whole if isinstance(shard, Tiled) else shard, to_shard=False)
            if isinstance(shard, Tiled):
                shard_moves = shard.resolve(shard_moves)
            for m in shard_moves:
                box = (m.dst, m.dst_row, m.dst_col, m.rows, m.cols)
                if box not in written:
                    written[box] = m
                    moves.append(m)
                    continue
                kept = written[box]  # a replica: the same box again, from another rank
                if (m.src_row, m.src_col, m.rows, m.cols) != (0, 0, m.src.rows, m.src.cols) or \
                        (kept.src_row, kept.src_col) != (0, 0) or kept.src.shape != m.src.shape:
                    raise MappingError(f"internal error: {t.placements[0].mcore_name} writes part of an HF tensor twice")
                tasks.append(CompareTask(kept.src, m.src, f"{t.placements[0].mcore_name}: replica {k} differs from "
                                         "replica 0 of a parameter that must be identical on every rank"))
        for part in parts:  # every byte of every HF tensor comes from some shard: no silent zeros
            if sum(m.rows * m.cols for m in moves if m.dst == part) != part.rows * part.cols:
                raise MappingError(f"internal error: the shards of {t.placements[0].mcore_name} do not cover "
                                   f"{Path(part.path).name}'s {part.shape}")
        moves += [dataclasses.replace(m, dst=extra) for m in moves for extra in copy_places.get(m.dst, ())]
        tasks += _move_tasks(copier, moves, _label(t))
    return tasks


def _compare_shards(first, second, message: str, source) -> list:
    (t1, shards1), (t2, shards2) = first, second
    if len(shards1) == len(shards2) and all(a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype
                                            for a, b in zip(shards1, shards2)):
        return [CompareTask(a, b, message) for a, b in zip(shards1, shards2)]

    def run(_copier) -> int:
        import torch

        a = t1.split.merge(source.load_shards(t1), t1.context)[0]
        b = t2.split.merge(source.load_shards(t2), t2.context)[0]
        if not torch.equal(a, b):
            raise MappingError(message)
        return 0

    return [CallTask(run, writes=())]


def _merge_through_torch(copier: Copier, t: Transfer, source, parts: list[Stored],
                         copy_places: dict[Stored, list[Stored]]) -> int:
    try:
        merged = t.split.merge(source.load_shards(t), t.context)
    except ValueError as exc:  # replicas that disagree
        raise MappingError(f"{t.placements[0].mcore_name}: {exc}")
    return sum(_write_tensor(copier, place, tensor, name) for name, part, tensor in zip(t.hf_names, parts, merged)
               for place in [part, *copy_places.get(part, ())])


def _write_hf_config(folder: Path, hf_config: dict, dtype: str) -> None:
    config = dict(hf_config)
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
    for k in keys:
        config[k] = dtype
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


class _LegacySource:
    """Shards of a transfer from the rank files that hold them (checked up front, located lazily).

    ``shards(t)`` gives one ``Stored`` per shard (None for a tensor that is not a dense run of its
    storage: those are read through torch by ``load_shards``). A shard is taken from the first rank
    file that holds it; the copies of a dense parameter in the other expert-parallel ranks' files are
    compared with it (``copy_checks``), since a run at this layout gives each EP rank its own file's,
    and ``check_all_read`` names any parameter that no rule read.
    """

    def __init__(self, release: Path, arch: Arch, layout: ParallelLayout, transfers: list[Transfer], hf_shapes: dict):
        self.files = open_rank_files(release, layout)
        self.used: set[tuple] = set()
        self.checks: dict = {}   # CRC-32s of the records read, checked beside the copies
        # Check names and shapes of every file against the plan before reading any data.
        expected: dict = {c: {} for c in self.files}
        weights = {p.mcore_name for t in transfers if t.floating for p in t.placements}
        for t in transfers:
            shapes = [tuple(hf_shapes[n]) for n in t.hf_names]
            blocks = t.split.blocks(shapes, t.num_shards, t.context)
            if blocks is not None:
                shard_shapes = [shard_shape(b, shapes) for b in blocks]
            else:
                import torch

                shard_shapes = [tuple(s.shape) for s in t.split.shards([torch.empty(s, device="meta") for s in shapes],
                                                                        t.num_shards, t.context)]
            for p in t.placements:
                for c in self.files:
                    if c.holds(t, p):
                        expected[c][p.mcore_name] = shard_shapes[p.shard]
        for c, (_, sd) in self.files.items():
            where = f"rank file TP={c.tp} PP={c.pp} EP={c.ep}"
            missing, extra = set(expected[c]) - set(sd), set(sd) - set(expected[c])
            if missing:
                raise MappingError(f"{where} lacks {len(missing)} parameter(s): {names_list(missing)}")
            if extra:
                raise MappingError(f"{where} has {len(extra)} parameter(s) no mapping rule reads: {names_list(extra)}")
            for name, shape in expected[c].items():
                if tuple(sd[name].shape) != shape:
                    raise MappingError(f"{where}: {name} has shape {tuple(sd[name].shape)}, expected {shape}")
                if name in weights:
                    _check_floating(sd[name].storage.dtype, f"{where} ({self.files[c][0].path}): {name}")

    def _find(self, t: Transfer, index: int):
        placements = [p for p in t.placements if p.shard == index]
        found = next(((c, p) for p in placements for c, (_, sd) in self.files.items()
                      if c.holds(t, p) and p.mcore_name in sd), None)
        if found is None:
            want = placements[0]
            raise MappingError(f"no rank state dict holds {want.mcore_name} (stage {want.pp}, shard {index}"
                               + (f", EP rank {want.ep})" if want.ep is not None else ")"))
        c, p = found
        self.used.add((c.pp, c.ep if t.expert else None, p.mcore_name))
        lazy, sd = self.files[c]
        record = lazy.record_check(sd[p.mcore_name])
        if record is not None:
            self.checks[record[:3]] = (record[3], f"record of {p.mcore_name}")
        return lazy, sd[p.mcore_name]

    def shards(self, t: Transfer) -> list[Stored | None]:
        return [lazy.stored(ref) for lazy, ref in (self._find(t, i) for i in range(t.num_shards))]

    def copy_checks(self, t: Transfer) -> list:
        """A dense parameter's copies in the other expert-parallel ranks' files, each compared with the copy that is
        read: copies that disagree were exported from EP rank 0's file without a word (the conv audit), where TP
        replicas that disagree are refused. A copy that is no dense run of its storage is compared through torch."""
        if t.expert:
            return []
        tasks = []
        for index in range(t.num_shards):
            lazy, ref = self._find(t, index)
            for p in (p for p in t.placements if p.shard == index):
                for c, (other_lazy, sd) in self.files.items():
                    other = sd.get(p.mcore_name)
                    if other is None or other is ref or not c.holds(t, p):
                        continue
                    message = (f"{p.mcore_name}: the copy in expert-parallel rank {c.ep}'s file differs from the one "
                               "in the first rank file's, of a parameter that must be identical on every rank")
                    a, b = lazy.stored(ref), other_lazy.stored(other)
                    if a is not None and b is not None:
                        tasks.append(CompareTask(a, b, message))
                    else:
                        tasks.append(CallTask(lambda copier, x=(lazy, ref), y=(other_lazy, other), m=message:
                                              _same_through_torch(x, y, m), writes=()))
        return tasks

    def load_shards(self, t: Transfer) -> list:
        return [lazy.load(ref) for lazy, ref in (self._find(t, i) for i in range(t.num_shards))]

    def crc_checks(self) -> dict:
        return self.checks

    def close(self) -> None:
        pass

    def check_all_read(self) -> None:
        """Data-parallel copies are legitimately left unread; a name no rank of its stage contributed is not."""
        unused = {name for c, (_, sd) in self.files.items() for name in sd
                  if (c.pp, None, name) not in self.used and (c.pp, c.ep, name) not in self.used}
        if unused:
            raise MappingError(f"MCore state dict has {len(unused)} parameter(s) no mapping rule reads: {names_list(unused)}")


def _same_through_torch(first, second, message: str) -> int:
    """Two legacy copies that are no dense runs of their storage (views), compared as tensors; 0 bytes written."""
    import torch

    if not torch.equal(first[0].load(first[1]), second[0].load(second[1])):
        raise MappingError(message)
    return 0


class _TorchDistSource:
    """Full (TP=1) parameters from the chunks of a torch_dist checkpoint, whatever chunks were stored."""

    def __init__(self, release: Path, skeleton: ModelSkeleton, weights: set[str], ignore=lambda key: False):
        """``weights``: the MCore names of the float parameters (``Transfer.floating``)."""
        self.reader = TorchDistReader(release)
        self.skeleton = skeleton
        self.chunks = defaultdict(list)
        for ch in skeleton.chunks:
            self.chunks[ch.name].append(ch)
        want = {ch.key: ch.global_shape for ch in skeleton.chunks}
        # Training state stored beside the weights (optimizer moments, main parameters) is skipped by name.
        have = {k for k in self.reader.tensor_keys() if not ignore(k) or k in want}
        if set(want) - have:
            raise MappingError(f"the torch_dist checkpoint lacks {len(set(want) - have)} tensor(s): {names_list(set(want) - have)}")
        if have - set(want):
            raise MappingError(f"the torch_dist checkpoint has {len(have - set(want))} tensor(s) the model does not: "
                               f"{names_list(have - set(want))}")
        for key, shape in want.items():
            if self.reader.global_shape(key) != shape:
                raise MappingError(f"torch_dist tensor {key} has shape {self.reader.global_shape(key)}, the model needs {shape}")
        for ch in skeleton.chunks:
            if ch.name in weights:
                _check_floating(self.reader.dtype(ch.key), f"the torch_dist checkpoint {release}: {ch.key}")
        self.read: set = set()

    def copy_checks(self, t: Transfer) -> list:
        return []  # one stored copy of each chunk: nothing to compare

    def shards(self, t: Transfer) -> list[Stored | Tiled]:
        """The (TP=1) parameter where its bytes are: one ``Stored`` when one stored chunk is exactly it,
        else ``Tiled``: the boxes of the stored chunks that hold each part of it (a TP>1 checkpoint's
        chunks, megatron's SwiGLU halves, a chunk holding several layers)."""
        name = t.placements[0].mcore_name
        shape = tuple(self.skeleton.shapes[name])
        tiles = []
        for ch in self.chunks[name]:
            self.read.add((ch.key, ch.global_offset))
            region = ch.region()
            for piece in self.reader.block(ch.key, ch.global_offset, ch.local_shape):
                start = tuple(r.start + d for r, d in zip(region, piece.dst_start[ch.prepend:]))
                tiles += box_tiles(shape, start, piece.size, piece.src, piece.src_start)
        if len(tiles) == 1:
            r0, r1, c0, c1, where, wr, wc = tiles[0]
            rows, cols = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
            if (r0, r1, c0, c1, wr, wc) == (0, rows, 0, cols, 0, 0) and where.shape[1:] == (cols,) \
                    and where.shape[0] == rows:
                return [Stored(where.path, where.offset, shape, where.dtype)]
        return [Tiled(shape, self.reader.dtype(self.chunks[name][0].key), tuple(tiles))]

    def load_shards(self, t: Transfer) -> list:
        """The parameter as a tensor, assembled by the project's own reader (for splits that are not
        rows and columns)."""
        import torch

        name = t.placements[0].mcore_name
        full = torch.empty(self.skeleton.shapes[name], dtype=getattr(torch, self.reader.dtype(self.chunks[name][0].key)))
        for ch in self.chunks[name]:
            self.read.add((ch.key, ch.global_offset))
            full[ch.region()] = self.reader.read_block(ch.key, ch.global_offset, ch.local_shape).reshape(
                full[ch.region()].shape)
        return [full]

    def crc_checks(self) -> dict:
        """The CRC-32 of every stored record read that opening it did not check (large tensor records)."""
        return self.reader.integrity

    def check_all_read(self) -> None:
        # Every stored chunk of every key lies in some block read (same blocks as written), so it is
        # enough that every block the model has was read once.
        unread = {f"{k}@{o}" for k, o in ((ch.key, ch.global_offset) for ch in self.skeleton.chunks)
                  if (k, o) not in self.read}
        if unread:
            raise MappingError(f"{len(unread)} torch_dist block(s) were never read: {names_list(unread)}")

    def close(self) -> None:
        self.reader.close()


def crc_tasks(checks: dict, skip=()) -> list:
    """Copier tasks that check the CRC-32 of each (path, offset, length) -> (crc, what) while the copies run,
    but in the files of ``skip`` (resolved paths)."""
    def check(_copier, path=None, offset=0, length=0, crc=0, what=""):
        try:
            check_crc(path, offset, length, crc, what)
        except ZipFormatError as exc:
            raise UserError(f"{path}: {exc}: the file is corrupt (a flipped byte or a damaged disk)")
        return 0

    skip = set(skip)
    return [CallTask(functools.partial(check, path=p, offset=o, length=n, crc=c, what=w), writes=(), reads=(p, o))
            for (p, o, n), (c, w) in checks.items() if Path(p).resolve() not in skip]
