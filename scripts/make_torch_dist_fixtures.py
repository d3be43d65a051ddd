"""Regenerate tests/fixtures/torch215_tp2pp2: a torch_dist checkpoint written by a newer torch's own
``dcp.save``, in the shape megatron-core writes, for the reader's tests.

    PYTHONPATH=. python scripts/make_torch_dist_fixtures.py --writer-python /path/to/venv-torch215/bin/python

The side venv (Python 3.12, ``PIP_CONSTRAINT=/dev/null pip install torch==2.15.0 numpy``) only writes;
this project's venv makes the model and the layout. What it holds:

- ``hf/``: a tiny Llama-3.1 (2 layers, hidden 16, vocabulary 64), bf16 safetensors: what an export must
  give back bit for bit;
- ``iter_0000001/``: the same weights as megatron-core lays them out at TP=2 PP=2 (layers stacked on a
  leading axis, one chunk per layer and TP rank, SwiGLU ``linear_fc1`` as gate and up halves each cut
  by TP, row-parallel weights cut on dim 1, norms saved once), saved by 4 gloo ranks with
  ``dcp.save`` through a container of several local chunks per key (megatron-core's
  ``LocalShardsContainer``), with its global metadata carrying ``all_local_plans`` as megatron-core's
  saver adds them; the distributed optimizer's ``dp_reshardable`` layout (one flattened 1-D bucket per
  rank and moment, one chunk per parameter, and the ``per_bucket_numel`` objects); megatron-core 0.19's
  ``common_state`` object and no ``common.pt``; ``metadata.json``; the tracker;
- ``VERSIONS.json``: which versions wrote it.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "torch215_tp2pp2"
CONFIG = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 8, "vocab_size": 64, "max_position_embeddings": 128}
TP, PP = 2, 2
ITERATION = 1


def tp_dim(key: str, ndim: int) -> int | None:
    """The dim (after the layer axis) megatron cuts by TP: row-parallel weights on dim 1, norms not at all."""
    if ndim == 1:
        return None
    return 1 if key.endswith(("linear_proj.weight", "linear_fc2.weight")) else 0


def stage_of(key: str, layer: int | None, layers: int) -> int:
    if layer is not None:
        return layer * PP // layers
    return 0 if "embedding" in key else PP - 1


def plan_chunks(skeleton, tensors: dict, layers: int) -> dict[int, list]:
    """rank -> [(key, global shape, offset, tensor)] at TP=2 PP=2, from the TP=1 skeleton chunks."""
    out: dict[int, list] = {r: [] for r in range(TP * PP)}
    for ch in skeleton.chunks:
        full = tensors[ch.key]
        layer = ch.global_offset[0] if ch.prepend else None
        pp = stage_of(ch.key, layer, layers)
        dim = tp_dim(ch.key, len(ch.local_shape) - ch.prepend)
        for tp in range(TP if dim is not None else 1):
            offset, size = list(ch.global_offset), list(ch.local_shape)
            if dim is not None:
                d = ch.prepend + dim
                size[d] //= TP
                offset[d] += tp * size[d]
            block = full[tuple(slice(o, o + s) for o, s in zip(offset, size))].contiguous()
            out[pp * TP + tp].append((ch.key, tuple(ch.global_shape), tuple(offset), block))
    return out


def prepare(out: Path, writer_python: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from megatron_patch.checkpoint_files.torch_dist import TorchDistReader
    from megatron_patch.convert.checkpoint import hf_to_mcore
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from megatron_patch.models.shape.skeleton import describe_model
    from megatron_patch.runtime import ParallelLayout

    work = Path(tempfile.mkdtemp(prefix="mpatch-fixture-"))
    try:
        hf = make_tiny_hf_checkpoint("llama3_1", work / "hf32", seed=215, **CONFIG)
        shutil.rmtree(out, ignore_errors=True)
        (out / "hf").mkdir(parents=True)
        tensors = {k: v.to(torch.bfloat16) for k, v in load_file(hf / "model.safetensors").items()}
        save_file(tensors, out / "hf" / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((hf / "config.json").read_text())
        config["torch_dtype"] = "bfloat16"
        config.pop("dtype", None)
        (out / "hf" / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        hf_to_mcore(out / "hf", work / "tp1", ParallelLayout(), fmt="torch_dist", progress=False)
        reader = TorchDistReader(work / "tp1" / "release")
        full = reader.read_all()
        skeleton = describe_model(parse_arch(out / "hf"))
        ranks = plan_chunks(skeleton, full, CONFIG["num_hidden_layers"])
        staging = work / "staging"
        staging.mkdir()
        for rank, items in ranks.items():
            torch.save([(k, g, o, t) for k, g, o, t in items], staging / f"rank{rank}.pt")
        folder = out / f"iter_{ITERATION:07d}"
        subprocess.run([writer_python, __file__, "--write", str(staging), str(folder)], check=True)
        (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                          "common_backend": "torch", "common_backend_version": 1}))
        (out / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        written = json.loads((staging / "versions.json").read_text())
        import megatron.core

        versions = {"written_by": written, "laid_out_by": {"python": sys.version.split()[0], "torch": torch.__version__,
                                                          "megatron-core": megatron.core.__version__},
                    "script": "scripts/make_torch_dist_fixtures.py"}
        (out / "VERSIONS.json").write_text(json.dumps(versions, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out} ({total / 1024:.0f} KiB)")


# --- the writer side (run by the newer torch) -----------------------------------------------------

def _write_rank(rank: int, staging: str, folder: str, port: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    class Chunks(torch.Tensor):
        """Several local chunks of one global tensor (megatron-core's ``LocalShardsContainer``)."""

        @staticmethod
        def __new__(cls, chunks):
            return torch.Tensor._make_wrapper_subclass(cls, chunks[0][2].size())

        def __init__(self, chunks):
            self.chunks = chunks   # [(global shape, offset, tensor)]

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError

        def __create_write_items__(self, fqn, obj):
            return [WriteItem(index=MetadataIndex(fqn, torch.Size(o), i), type=WriteItemType.SHARD,
                              tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(o), t.size()),
                                                          properties=TensorProperties.create_from_tensor(t),
                                                          size=torch.Size(g)))
                    for i, (g, o, t) in enumerate(self.chunks)]

        def __create_chunk_list__(self):
            return [ChunkStorageMetadata(torch.Size(o), t.size()) for _, o, t in self.chunks]

        def __get_tensor_shard__(self, index):
            if index.index is not None and index.index < len(self.chunks) and \
                    tuple(self.chunks[index.index][1]) == tuple(index.offset):
                return self.chunks[index.index][2]
            return next(t for _, o, t in self.chunks if tuple(o) == tuple(index.offset))

    class MegatronLikePlanner(DefaultSavePlanner):
        """megatron-core's saver: every rank's local plan kept in the global metadata, byte objects as given."""

        def create_global_plan(self, all_plans):
            plans, metadata = super().create_global_plan(all_plans)
            metadata.all_local_plans = all_plans
            return plans, metadata

        def transform_object(self, write_item, object):
            return object  # byte objects are torch.save bytes already (megatron-core's MCoreSavePlanner)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP * PP)
    items = torch.load(Path(staging) / f"rank{rank}.pt", weights_only=True)
    by_key: dict = {}
    for key, g, o, t in items:
        by_key.setdefault(key, []).append((g, o, t))
    state: dict = {key: Chunks(chunks) for key, chunks in by_key.items()}
    # The distributed optimizer's dp_reshardable layout: this rank's parameters flattened, one after the
    # other, into one 1-D bucket per moment, each parameter a chunk of it (DP = 1).
    group = f"optimizer.distributed.dp_group_idx_{rank}"
    sizes = [t.numel() for _, _, _, t in items]
    numel = sum(sizes)
    for moment, fn in (("exp_avg", lambda t: t.float() * 0.5), ("exp_avg_sq", lambda t: t.float() ** 2)):
        chunks, at = [], 0
        for (_, _, _, t), n in zip(items, sizes):
            chunks.append(((numel,), (at,), fn(t).reshape(-1)))
            at += n
        state[f"{group}.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0.{moment}"] = Chunks(chunks)
    for name, value in (("per_bucket_numel", {0: {"bf16": [[numel]]}}), ("per_bucket_numel_unpadded", {0: {"bf16": [numel]}})):
        buf = io.BytesIO()
        torch.save([value], buf)
        state[f"{group}.{name}/shard_0_1"] = buf
    if rank == 0:  # megatron-core 0.19's common state: one object, no common.pt
        buf = io.BytesIO()
        torch.save([{"iteration": ITERATION, "checkpoint_version": 3.0, "num_floating_point_operations_so_far": 0}], buf)
        state["common_state/shard_0_1"] = buf
    dcp.save(state, checkpoint_id=folder, planner=MegatronLikePlanner(dedup_replicated_tensors=False))
    dist.barrier()
    dist.destroy_process_group()


def write(staging: Path, folder: Path) -> None:
    import socket

    import numpy
    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_write_rank, args=(str(staging), str(folder), port), nprocs=TP * PP, join=True)
    (staging / "versions.json").write_text(json.dumps({"python": sys.version.split()[0], "torch": torch.__version__,
                                                       "numpy": numpy.__version__, "writer": "torch.distributed.checkpoint.save"}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writer-python", help="python of the side venv with the newer torch")
    parser.add_argument("--out", type=Path, default=FIXTURE)
    parser.add_argument("--write", nargs=2, type=Path, metavar=("STAGING", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:
        write(*args.write)
    elif not args.writer_python:
        parser.error("--writer-python is required")
    else:
        prepare(args.out, args.writer_python)


if __name__ == "__main__":
    main()
