"""The converter's byte-level machinery: split blocks, the torch-free file formats, the copier.

Each piece is checked against torch's own implementation of the same thing (``Split.shards`` /
``merge``, ``torch.load``, torch's distributed-checkpoint reader), and the zero-copy path against the
path through memory, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from megatron_patch.models.mapping import plan_transfers, split_context
from megatron_patch.models.registry import families, parse_arch
from megatron_patch.runtime import ParallelLayout

FAMILIES = sorted(families())


def _apply_blocks(blocks, parts):
    """A shard made of ``blocks`` of ``parts``, the slow and obvious way."""
    out = []
    for shard in blocks:
        pieces = []
        for b in shard:
            if b.part is None:
                pieces.append(parts[0].new_zeros((b.num_rows,) + tuple(parts[0].shape[1:])))
                continue
            t = parts[b.part][b.rows[0]:b.rows[1]]
            pieces.append(t if b.cols is None else t[:, b.cols[0]:b.cols[1]])
        out.append(torch.cat(pieces, 0))
    return out


def _layouts(arch):
    out = [ParallelLayout(tp=tp) for tp in (1, 2, 4) if arch.num_kv_heads % tp == 0]
    if arch.is_moe:
        out.append(ParallelLayout(tp=2, ep=2, etp=1))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_describe_exactly_what_shards_and_merge_do(family, hf_shapes):
    """For every rule of every family's table and several layouts, the shards built from the blocks
    equal ``Split.shards`` bit for bit, and the HF tensors put back from them equal ``Split.merge``."""
    fam = families()[family]
    arch = parse_arch(fam.tiny_config)
    ctx = split_context(arch)
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for layout in _layouts(arch):
        for t in plan_transfers(fam.weight_rules(arch), arch, layout):
            shapes = [hf_shapes[family][n] for n in t.hf_names]
            parts = [torch.randn(s, generator=gen) for s in shapes]
            blocks = t.split.blocks(shapes, t.num_shards, ctx)
            assert blocks is not None, t.split
            want = t.split.shards(parts, t.num_shards, ctx)
            got = _apply_blocks(blocks, parts)
            assert len(got) == len(want)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), (t.placements[0].mcore_name, layout)
            # Back: every HF tensor rebuilt from the blocks' boxes of the shards equals merge().
            back = [torch.full(s, float("nan")) for s in shapes]
            for shard, shard_blocks in zip(want, blocks):
                row = 0
                for b in shard_blocks:
                    if b.part is not None:
                        box = back[b.part][b.rows[0]:b.rows[1]]
                        box = box if b.cols is None else box[:, b.cols[0]:b.cols[1]]
                        box.copy_(shard[row:row + b.num_rows])
                    row += b.num_rows
            merged = t.split.merge(want, ctx)
            assert all(torch.equal(b, m) for b, m in zip(back, merged)), t.placements[0].mcore_name
            checked += 1
    assert checked > 20


@pytest.fixture(scope="module")
def hf_shapes(tmp_path_factory) -> dict:
    """Every family's tiny checkpoint's tensor shapes, as its safetensors store them."""
    from megatron_patch.convert.hf_reader import HFCheckpointReader
    from megatron_patch.models.tiny import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for family in FAMILIES:
        reader = HFCheckpointReader(make_tiny_hf_checkpoint(family, root / family))
        out[family] = {n: reader.shape(n) for n in reader.keys()}
    return out
