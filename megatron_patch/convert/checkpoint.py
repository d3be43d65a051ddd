"""HF model folder <-> MCore checkpoint folder, streaming: what ``mpatch convert`` runs.

Both directions run the family's weight table through ``plan_transfers``; each transfer reads its
source tensors once, cuts or glues them (exact slicing and concatenation), and hands the results to
a writer that puts them on disk at once. Reading and cutting run one transfer ahead on a helper
thread (``prefetch.Prefetcher``) while the writer writes the current one, so memory holds the
tensors of two transfers at most (plus, with tied embeddings, the embedding until its second user
is done), never the model.

Every check that can be made before reading weights is made first: config.json, the layout, every
HF tensor's presence and shape against what megatron-core builds for that config. Output goes to a
temporary sibling folder that is renamed onto the target only when complete.
"""

from __future__ import annotations

import dataclasses
import io
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch

from megatron_patch.checkpoint_layout import RELEASE, write_tracker
from megatron_patch.convert.engine import (
    HFAssembler, MappingError, RankShards, check_hf_names, check_tied_copies, names_list, plan)
from megatron_patch.convert.arch_source import open_checkpoint
from megatron_patch.convert.foreign import TRAINING_STATE_PREFIXES
from megatron_patch.convert.fp8 import DequantizingReader, open_weights
from megatron_patch.convert.hf_reader import HFCheckpointReader
from megatron_patch.convert.hf_writer import SafetensorsShardWriter, parse_size
from megatron_patch.convert.legacy import (
    CHECKPOINT_VERSION, check_legacy_layout, open_rank_files, rank_coords, rank_file)
from megatron_patch.models.mapping import Transfer, split_context
from megatron_patch.models.mapping.splits import Replicated
from megatron_patch.convert.outputs import atomic_output_dir, copy_carried
from megatron_patch.convert.prefetch import Prefetcher
from megatron_patch.convert.progress import Progress
from megatron_patch.convert.sidecar import Sidecar
from megatron_patch.convert.skeleton import ModelSkeleton, describe_model
from megatron_patch.convert.torch_dist import TorchDistReader, bytes_item, tensor_item, write_torch_dist
from megatron_patch.convert.torch_files import StreamingTorchSave, TensorSpec
from megatron_patch.dtypes import HF_CONFIG_NAMES, PRECISION_NAMES, precision_dtype
from megatron_patch.errors import UserError
from megatron_patch.models.registry import get_family, parse_arch
from megatron_patch.models.arch import Arch, validate_layout
from megatron_patch.runtime.distributed import ParallelLayout

FORMATS = ("torch_dist", "legacy")


def _meta(shape) -> torch.Tensor:
    return torch.empty(tuple(shape), device="meta")


def expected_hf_shapes(arch: Arch, transfers_tp1: list[Transfer], skeleton: ModelSkeleton) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor, derived from the parameters megatron-core builds for ``arch``.

    Also checks that the weight table writes every parameter of the model and nothing else.
    """
    ctx = split_context(arch)
    planned, out = set(), {}
    for t in transfers_tp1:
        name = t.placements[0].mcore_name
        planned.add(name)
        if name not in skeleton.shapes:
            raise MappingError(f"the {arch.family} weight table writes {name}, which the MCore model does not have")
        shape = skeleton.shapes[name]
        hf_shapes = [shape] * len(t.hf_names) if isinstance(t.split, Replicated) else \
            [tuple(m.shape) for m in t.split.merge([_meta(shape)], ctx)]
        for hf_name, s in zip(t.hf_names, hf_shapes):
            out.setdefault(hf_name, tuple(s))
    unplanned = set(skeleton.shapes) - planned
    if unplanned:
        raise MappingError(f"no {arch.family} mapping rule writes {len(unplanned)} MCore parameter(s): {names_list(unplanned)}")
    return out


class _ReadOnce:
    """HF tensors by name, each read from disk once: kept only while another transfer still needs it."""

    def __init__(self, reader: HFCheckpointReader, transfers: list[Transfer], progress: Progress | None):
        self.reader, self.progress = reader, progress
        self.uses = Counter(n for t in transfers for n in t.hf_names)
        self.cache: dict[str, torch.Tensor] = {}
        self.reads: Counter = Counter()

    def get(self, name: str) -> torch.Tensor:
        tensor = self.cache.get(name)
        if tensor is None:
            tensor = self.reader.get(name)
            self.reads[name] += 1
            if self.progress is not None:
                self.progress.update(tensor.nbytes)
        self.uses[name] -= 1
        if self.uses[name] > 0:
            self.cache[name] = tensor
        else:
            self.cache.pop(name, None)
        return tensor


def _choose_dtype(reader: HFCheckpointReader, names, dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        if isinstance(dtype, torch.dtype):
            return dtype
        return precision_dtype(dtype)
    found = {reader.dtype(n) for n in names}
    if len(found) == 1 and next(iter(found)) in PRECISION_NAMES:
        return next(iter(found))
    raise UserError(f"the HF tensors are stored as {sorted(map(str, found))}: pass --dtype bf16, fp16 or fp32")


# --- HF -> MCore -------------------------------------------------------------------------------

def hf_to_mcore(hf_dir: str | Path, save_dir: str | Path, layout: ParallelLayout, fmt: str = "torch_dist",
                dtype: str | torch.dtype | None = None, force: bool = False, progress: bool | None = None,
                mtp: bool = False) -> Sidecar:
    """Convert an HF model folder into an MCore checkpoint folder (``fmt``: torch_dist or legacy).

    FP8 block-scaled weights are dequantized on the way (``convert.fp8``). Multi-token-prediction
    layers go into megatron-core's MTP block with ``mtp``; without it they are dropped, with a count
    printed and a note in the sidecar."""
    if fmt not in FORMATS:
        raise UserError(f"unknown checkpoint format {fmt!r}: choose {' or '.join(FORMATS)}")
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise UserError(f"{hf_dir} is not a folder: point --hf-dir at a Hugging Face model folder")
    arch = parse_arch(hf_dir)
    family = get_family(arch.family)
    validate_layout(arch, layout)
    if fmt == "legacy":
        check_legacy_layout(layout)
    from megatron_patch.convert.outputs import check_target

    check_target(save_dir, force, inputs=(hf_dir,))  # fail before the slow part
    reader = open_weights(HFCheckpointReader(hf_dir), arch.hf_config)
    notes = []
    if isinstance(reader, DequantizingReader):
        notes.append(f"weights dequantized from FP8 ({reader.block[0]}x{reader.block[1]} block scales); "
                     "quantization_config removed from the config")
        arch = dataclasses.replace(arch, hf_config={k: v for k, v in arch.hf_config.items() if k != "quantization_config"})
    available, arch = _multi_token_prediction(family, arch, reader, mtp, notes)
    tp1 = plan(family, arch, ParallelLayout())
    check_hf_names(family, arch, tp1, available)
    torch_dtype = _choose_dtype(reader, [n for t in tp1 for n in t.hf_names], dtype)
    skeleton = describe_model(arch)
    for name, shape in expected_hf_shapes(arch, tp1, skeleton).items():
        if tuple(reader.shape(name)) != shape:
            raise UserError(f"{name} has shape {tuple(reader.shape(name))} but config.json implies {shape}: "
                            "the weights and config.json do not belong together")
    check_tied_copies(family, arch, reader.get, reader)

    transfers = tp1 if fmt == "torch_dist" else plan(family, arch, layout)
    hf_names = sorted({n for t in transfers for n in t.hf_names})
    bar = Progress(f"hf2mcore {fmt} {layout}", sum(reader.nbytes(n) for n in hf_names), len(hf_names), progress)
    once = _ReadOnce(reader, transfers, bar)
    with atomic_output_dir(save_dir, force, inputs=(hf_dir,)) as tmp:
        release = tmp / RELEASE
        release.mkdir()
        if fmt == "legacy":
            count, nbytes = _write_legacy(release, arch, layout, transfers, once, torch_dtype)
        else:
            count, nbytes = _write_torch_dist(release, arch, transfers, once, torch_dtype, skeleton)
        twice = [n for n, c in once.reads.items() if c > 1]
        if twice or set(once.reads) != set(hf_names):
            raise MappingError(f"internal error: HF tensors read {'more than once' if twice else 'not at all'}: "
                               f"{names_list(twice or set(hf_names) - set(once.reads))}")
        sidecar = Sidecar.create(fmt, arch, layout, torch_dtype, carried_files=copy_carried(hf_dir, tmp),
                                 num_tensors=count, num_bytes=nbytes, source=str(hf_dir.resolve()), notes=notes)
        sidecar.write(tmp)
        # Written last: Megatron treats a folder with this file as a finished checkpoint.
        write_tracker(tmp, RELEASE)
    bar.close()
    return sidecar


def _multi_token_prediction(family, arch: Arch, reader, keep: bool, notes: list[str]) -> tuple[set[str], Arch]:
    """(the HF tensors to convert, the model to build): with ``keep``, the MTP layers join the model;
    without, their tensors are left out, loudly."""
    names, count = set(reader.keys()), family.hf_mtp_layers(arch.hf_config)
    if keep:
        if not count:
            raise UserError("--mtp: this checkpoint's config.json declares no multi-token-prediction layers")
        return names, dataclasses.replace(arch, mtp_layers=count)
    prefixes = tuple(f"{family.hf_modules.layers}.{arch.num_layers + k}." for k in range(count))
    dropped = {n for n in names if n.startswith(prefixes)} if count else set()
    if dropped:
        note = (f"{len(dropped)} tensors of {count} multi-token-prediction layer(s) were not converted "
                "(convert with --mtp to keep them)")
        print(f"hf2mcore: {note}", file=sys.stderr, flush=True)
        notes.append(note)
    return names - dropped, arch


def _write_legacy(release: Path, arch: Arch, layout: ParallelLayout, transfers: list[Transfer], once: _ReadOnce,
                  dtype: torch.dtype) -> tuple[int, int]:
    ctx = split_context(arch)
    coords = rank_coords(layout)
    holders = {}  # (transfer index, placement) -> coords that store it
    specs: dict = {c: {} for c in coords}
    for i, t in enumerate(transfers):
        shards = t.split.shards([_meta(once.reader.shape(n)) for n in t.hf_names], t.num_shards, ctx)
        for p in t.placements:
            holders[(i, p)] = [c for c in coords if c.holds(t, p)]
            for c in holders[(i, p)]:
                specs[c][p.mcore_name] = TensorSpec(tuple(shards[p.shard].shape), t.dtype_in(dtype))
    writers = {}
    for c in coords:
        path = rank_file(release, c, layout)
        path.parent.mkdir(parents=True)
        writers[c] = StreamingTorchSave(path, {"model": specs[c], "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0})
    count = nbytes = 0

    def produce(item):  # on the prefetch thread: read and cut transfer i+1 while transfer i is written
        _, t = item
        return t.split.shards([once.get(n).to(t.dtype_in(dtype)) for n in t.hf_names], t.num_shards, ctx)

    with Prefetcher(enumerate(transfers), produce) as ahead:
        for (i, t), shards in ahead:
            for p in t.placements:
                for c in holders[(i, p)]:
                    writers[c].write(("model", p.mcore_name), shards[p.shard])
                    count += 1
                    nbytes += shards[p.shard].nbytes
            del shards
    for w in writers.values():
        w.close()
    return count, nbytes


def _write_torch_dist(release: Path, arch: Arch, transfers: list[Transfer], once: _ReadOnce, dtype: torch.dtype,
                      skeleton: ModelSkeleton) -> tuple[int, int]:
    ctx = split_context(arch)
    by_name = {t.placements[0].mcore_name: t for t in transfers}
    chunks = defaultdict(list)
    for ch in skeleton.chunks:
        if ch.name not in by_name:
            raise MappingError(f"the model's sharded state dict has {ch.name}, which no mapping rule writes")
        chunks[ch.name].append(ch)
    items, sources = [], {}
    for name in by_name:
        for ch in chunks[name]:
            items.append(tensor_item(ch.key, ch.global_shape, ch.global_offset, ch.local_shape,
                                     by_name[name].dtype_in(dtype)))
            sources[(ch.key, ch.global_offset)] = ch
    payloads = {obj.unique_key: obj.payload for obj in skeleton.objects}
    items += [bytes_item(key) for key in payloads]
    current: dict = {"name": None, "tensor": None}
    # The writer asks for the items in this order, so the parameters are needed in this order.
    order = list(dict.fromkeys(sources[(it.index.fqn, tuple(it.index.offset))].name
                               for it in items if it.index.offset is not None))

    def produce(name):  # on the prefetch thread
        t = by_name[name]
        return t.split.shards([once.get(n).to(t.dtype_in(dtype)) for n in t.hf_names], 1, ctx)[0]

    def resolve(item):
        if item.index.offset is None:
            return io.BytesIO(payloads[item.index.fqn])
        ch = sources[(item.index.fqn, tuple(item.index.offset))]
        if current["name"] != ch.name:
            current["tensor"] = None
            name, tensor = next(ahead)
            if name != ch.name:
                raise MappingError(f"internal error: the writer asks for {ch.name} before {name}")
            current.update(name=name, tensor=tensor)
            del tensor
        return current["tensor"][ch.region()].reshape(ch.local_shape)

    with Prefetcher(order, produce) as ahead:
        write_torch_dist(release, items, resolve)
        current["tensor"] = None
    nbytes = sum(torch.Size(ch.local_shape).numel() for ch in skeleton.chunks) * torch.empty((), dtype=dtype).element_size()
    return len(skeleton.chunks), nbytes


# --- MCore -> HF -------------------------------------------------------------------------------

def mcore_to_hf(load_dir: str | Path, save_dir: str | Path, dtype: str | torch.dtype | None = None,
                max_shard_size: str | int = "5GB", force: bool = False, progress: bool | None = None,
                hf_config: str | Path | None = None, family: str | None = None, iteration: int | None = None) -> Path:
    """Convert a Megatron-Core checkpoint into an HF model folder.

    ``load_dir`` is any torch_dist or legacy checkpoint (its root, or one iteration or release folder):
    one written here (hf2mcore, a training run or its final export: the sidecar says everything) or
    by another tool, whose architecture comes from ``hf_config`` or from its saved Megatron-LM
    arguments read as ``family`` (``convert.arch_source``). Optimizer state is skipped; ``iteration`` picks
    an older iteration than the tracker's."""
    opened = open_checkpoint(load_dir, hf_config=hf_config, family=family, iteration=iteration)
    for note in opened.found.notes + opened.notes:
        print(f"warning: {note}", file=sys.stderr, flush=True)
    load_dir, data_dir, sidecar = opened.sidecar_dir, opened.found.folder, opened.sidecar
    arch = sidecar.arch
    if (arch.vocab_size, arch.padded_vocab_size()) != (sidecar.vocab_size, sidecar.padded_vocab_size):
        raise UserError(f"the sidecar's vocabulary ({sidecar.vocab_size}, padded {sidecar.padded_vocab_size}) "
                        f"disagrees with its config ({arch.vocab_size}, padded {arch.padded_vocab_size()})")
    family = get_family(arch.family)
    out_dtype = sidecar.torch_dtype if dtype is None else _choose_dtype(None, [], dtype)
    max_bytes = parse_size(max_shard_size)
    from megatron_patch.convert.outputs import check_target

    check_target(save_dir, force, inputs=(load_dir,))
    skeleton = describe_model(arch)
    tp1 = plan(family, arch, ParallelLayout())
    hf_shapes = expected_hf_shapes(arch, tp1, skeleton)
    release = data_dir
    if sidecar.checkpoint_format == "legacy":
        layout = sidecar.parallel_layout
        validate_layout(arch, layout)
        check_legacy_layout(layout)
        transfers = plan(family, arch, layout)
        source = _LegacySource(release, arch, layout, transfers, hf_shapes)
    else:
        transfers = tp1
        source = _TorchDistSource(release, skeleton, ignore_prefixes=TRAINING_STATE_PREFIXES)
    entries, seen, made_by = [], set(), {}
    for t in transfers:
        for n in t.hf_names:
            if n not in seen:
                seen.add(n)
                made_by[n] = t
                entries.append((n, hf_shapes[n], t.dtype_in(out_dtype)))
    # HF tensors that repeat others (an MTP layer's embedding and head), written again at the end.
    copies = family.hf_copies(arch)
    entries += [(copy, hf_shapes[src], made_by[src].dtype_in(out_dtype)) for copy, src in copies.items()]
    bar = Progress(f"mcore2hf {sidecar.checkpoint_format}", sum(torch.Size(s).numel() for _, s, _ in entries)
                   * torch.empty((), dtype=out_dtype).element_size(), len(entries), progress)
    with atomic_output_dir(save_dir, force, inputs=(load_dir,)) as tmp:
        writer = SafetensorsShardWriter(tmp, entries, max_bytes)
        assembler = HFAssembler(arch, source, pieces=True)

        def produce(t: Transfer):
            """On the prefetch thread: read transfer i+1's shards and cut them into HF pieces."""
            merged = assembler.assemble(t)
            return None if merged is None else [[piece.to(t.dtype_in(out_dtype)) for piece in pieces] for pieces in merged]

        with Prefetcher(transfers, produce) as ahead:
            for t, merged in ahead:
                if merged is None:
                    continue
                for n, pieces in zip(t.hf_names, merged):
                    writer.write_pieces(n, hf_shapes[n], pieces)
                    bar.update(sum(piece.nbytes for piece in pieces))
                del merged
        for copy, src in copies.items():  # read again rather than held: memory stays at one tensor
            t = made_by[src]
            pieces = assembler.merge(t)[t.hf_names.index(src)]
            writer.write_pieces(copy, hf_shapes[src], [piece.to(t.dtype_in(out_dtype)) for piece in pieces])
            bar.update(sum(piece.nbytes for piece in pieces))
        writer.close()
        source.check_all_read()
        _write_hf_config(tmp, sidecar.hf_config, out_dtype)
        copy_carried(load_dir, tmp, sidecar.carried_files)
    bar.close()
    return Path(save_dir)


def _write_hf_config(folder: Path, hf_config: dict, dtype: torch.dtype) -> None:
    import json

    config = dict(hf_config)
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
    for k in keys:
        config[k] = HF_CONFIG_NAMES[dtype]
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


class _LegacySource(RankShards):
    """Shards of a transfer from the rank files that hold them (read lazily, checked up front)."""

    def __init__(self, release: Path, arch: Arch, layout: ParallelLayout, transfers: list[Transfer], hf_shapes: dict):
        files = open_rank_files(release, layout)
        super().__init__(files, load=lambda lazy: lazy.load())
        # Check names and shapes of every file against the plan before reading any data.
        ctx = split_context(arch)
        expected: dict = {c: {} for c in files}
        for t in transfers:
            shards = t.split.shards([_meta(hf_shapes[n]) for n in t.hf_names], t.num_shards, ctx)
            for p in t.placements:
                for c in files:
                    if c.holds(t, p):
                        expected[c][p.mcore_name] = tuple(shards[p.shard].shape)
        for c, sd in files.items():
            where = f"rank file TP={c.tp} PP={c.pp} EP={c.ep}"
            missing, extra = set(expected[c]) - set(sd), set(sd) - set(expected[c])
            if missing:
                raise MappingError(f"{where} lacks {len(missing)} parameter(s): {names_list(missing)}")
            if extra:
                raise MappingError(f"{where} has {len(extra)} parameter(s) no mapping rule reads: {names_list(extra)}")
            for name, shape in expected[c].items():
                if tuple(sd[name].shape) != shape:
                    raise MappingError(f"{where}: {name} has shape {tuple(sd[name].shape)}, expected {shape}")


class _TorchDistSource:
    """Full (TP=1) parameters assembled from the chunks of a torch_dist checkpoint."""

    def __init__(self, release: Path, skeleton: ModelSkeleton, ignore_prefixes: tuple[str, ...] = ()):
        self.reader = TorchDistReader(release)
        self.skeleton = skeleton
        self.chunks = defaultdict(list)
        for ch in skeleton.chunks:
            self.chunks[ch.name].append(ch)
        want = {ch.key: ch.global_shape for ch in skeleton.chunks}
        # Training state stored beside the weights (optimizer moments, main parameters) is skipped by name.
        have = {k for k in self.reader.tensor_keys() if not k.startswith(ignore_prefixes) or k in want}
        if set(want) - have:
            raise MappingError(f"the torch_dist checkpoint lacks {len(set(want) - have)} tensor(s): {names_list(set(want) - have)}")
        if have - set(want):
            raise MappingError(f"the torch_dist checkpoint has {len(have - set(want))} tensor(s) the model does not: "
                               f"{names_list(have - set(want))}")
        for key, shape in want.items():
            if self.reader.global_shape(key) != shape:
                raise MappingError(f"torch_dist tensor {key} has shape {self.reader.global_shape(key)}, the model needs {shape}")
        self.read: set = set()

    def shards(self, t: Transfer) -> list[torch.Tensor]:
        name = t.placements[0].mcore_name
        full = torch.empty(self.skeleton.shapes[name], dtype=self.reader.dtype(self.chunks[name][0].key))
        requests, copies = [], []
        for ch in self.chunks[name]:
            region = full[ch.region()]
            if region.is_contiguous():  # (at TP=1 a chunk is a whole parameter) read straight into place
                block = region.view(ch.local_shape)
            else:
                block = torch.empty(ch.local_shape, dtype=full.dtype)
                copies.append((region, block))
            requests.append((ch.key, ch.global_offset, block))
        self.reader.load(requests)
        for region, block in copies:
            region.copy_(block.reshape(region.shape))
        for ch in self.chunks[name]:
            self.read.add((ch.key, ch.global_offset))
        return [full]

    def check_all_read(self) -> None:
        # Every stored chunk of every key lies in some block read (same blocks as written), so it is
        # enough that every block the model has was read once.
        unread = {f"{k}@{o}" for k, o in ((ch.key, ch.global_offset) for ch in self.skeleton.chunks)
                  if (k, o) not in self.read}
        if unread:
            raise MappingError(f"{len(unread)} torch_dist block(s) were never read: {names_list(unread)}")
