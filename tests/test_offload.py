"""Optimizer offload, piece by piece (no processes): the chunk plan, the store's moves, the update
formulas, the step counter, the policy and the probes. tests/test_offload_training.py runs it all in
training.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from megatron_patch.errors import UserError
from megatron_patch.training.offload.adam import ChunkedAdam, correctly_rounded_sqrt, exact_adamw_, torch_adamw_
from megatron_patch.training.offload.chunks import (
    DEVICE, HOST, ChunkStore, Span, capacity_candidates, choose_capacity, host_chunk_count, next_fit, plan_chunks, waste)
from megatron_patch.training.offload.policy import AutoPolicy, StaticPolicy
from megatron_patch.training.offload.probe import Accounting, CudaProbe, MemoryReading, ScriptedProbe

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run scripts/gpu_suite.sh there)")


def _shard(sizes: list[int], start: int = 0, align: int = 64, key0: int = 0) -> list[Span]:
    """Spans laid out as megatron's buffer lays out parameters: each start aligned to 64 elements."""
    spans, pos = [], start
    for i, n in enumerate(sizes):
        pos = -(-pos // align) * align
        spans.append(Span(key0 + i, pos, pos + n))
        pos += n
    return spans


# --- the chunk plan -------------------------------------------------------------------------------------

def test_next_fit_keeps_chunks_contiguous_and_within_capacity():
    rng = random.Random(0)
    spans = _shard([rng.randint(1, 900) for _ in range(200)] + [5000, 3])
    for capacity in (256, 1000, 4096):
        groups = next_fit(spans, capacity)
        assert [s for g in groups for s in g] == spans  # every span once, in order
        for g in groups:
            extent = g[-1].end - g[0].start
            assert extent <= capacity or len(g) == 1  # only a span larger than a chunk stands alone
        # next-fit: a chunk was closed only because the next span did not fit
        for a, b in zip(groups, groups[1:]):
            assert b[0].end - a[0].start > capacity


def test_chunk_capacity_has_the_least_fragmentation_of_its_candidates():
    rng = random.Random(1)
    segments = [_shard([rng.randint(10, 3000) for _ in range(60)]), _shard([rng.randint(10, 3000) for _ in range(40)],
                                                                        start=10**6)]
    chosen = choose_capacity(segments)
    candidates = capacity_candidates(segments)
    total = sum(s[-1].end - s[0].start for s in segments)
    assert len(candidates) > 20 and total // 128 <= candidates[0] and candidates[-1] <= total // 16 + 128
    assert all(waste(segments, chosen) <= waste(segments, c) for c in candidates)
    assert len({waste(segments, c) for c in candidates}) > 1  # the choice mattered
    plan = plan_chunks([(0, segments[0]), (1, segments[1])])
    assert plan.capacity == chosen
    assert {c.buffer for c in plan.chunks} == {0, 1}  # never across shards
    assert sum(c.state_numel for c in plan.chunks) == sum(s.numel for seg in segments for s in seg)
    assert 0 <= plan.fragmentation < 0.2, plan.fragmentation
    assert all(c.capacity % 64 == 0 and c.capacity >= c.numel for c in plan.chunks)


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.25, 0.5, 0.73, 0.9, 1.0])
def test_static_share_is_the_users_ratio_within_one_chunk(ratio):
    rng = random.Random(2)
    plan = plan_chunks([(0, _shard([rng.randint(50, 2000) for _ in range(300)]))])
    host = host_chunk_count(plan.chunks, ratio)
    share = sum(c.state_numel for c in plan.chunks[len(plan.chunks) - host:]) / plan.state_numel if host else 0.0
    largest = max(c.state_numel for c in plan.chunks) / plan.state_numel
    assert abs(share - ratio) <= largest / 2 + 1e-12, (share, ratio, largest)
    assert (host == len(plan.chunks)) == (ratio == 1.0)


# --- the store -------------------------------------------------------------------------------------------

def _awkward_values(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-40, 30, n)
    x[::97] = float("nan")
    x[::89] = float("inf")
    x[::83] = -0.0
    x[::79] = 1e-42  # subnormal
    return x.float()


def test_moves_are_bit_exact_and_re_point_every_view():
    plan = plan_chunks([(0, _shard([300, 70, 1000, 5]))], capacity=512)
    store = ChunkStore(plan, torch.device("cpu"))
    store.allocate([DEVICE] * len(plan.chunks))
    mains = {s.key: torch.empty(0) for c in plan.chunks for s in c.spans}
    states = {k: {} for k in mains}
    for c in plan.chunks:
        for s in c.spans:
            store.bind_main_param(c.index, s, mains[s.key])
            store.bind_state(c.index, s, states[s.key])
    for c in plan.chunks:
        store.data[c.index].copy_(_awkward_values(store.data[c.index].numel(), c.index).view_as(store.data[c.index]))
    before = [t.clone() for t in store.data]
    moved = sum(store.move(c.index, HOST) for c in plan.chunks)
    assert moved == sum(c.nbytes for c in plan.chunks) and store.bytes_on(DEVICE) == 0
    assert store.move(0, HOST) == 0  # already there
    for c in plan.chunks[::2]:
        store.move(c.index, DEVICE)
    for t0, t1 in zip(before, store.data):
        assert torch.equal(t0.view(torch.int32), t1.view(torch.int32))  # bits, NaN payloads included
    for c in plan.chunks:
        for s in c.spans:
            buf = store.data[c.index]
            assert mains[s.key].data_ptr() == store.span_view(c.index, "param", s).data_ptr()
            assert mains[s.key].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            assert states[s.key]["exp_avg_sq"].data_ptr() == store.span_view(c.index, "exp_avg_sq", s).data_ptr()
            assert mains[s.key].numel() == s.numel


# --- the update formulas ---------------------------------------------------------------------------------

def _adam_inputs(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    p, grad = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2
    m, v = torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-5
    return p, grad, m, v


HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def test_exact_formula_does_not_depend_on_where_an_element_sits():
    """The same elements updated as one long tensor, or in pieces of odd lengths at odd offsets, give the same
    bits: no vectorised body / scalar tail difference, nothing fused."""
    p, g, m, v = _adam_inputs(10_007, 0)
    whole = [t.clone() for t in (p, g, m, v)]
    exact_adamw_([whole[0]], [whole[1]], [whole[2]], [whole[3]], step=7, **HYPER)
    pieces = [t.clone() for t in (p, g, m, v)]
    cuts = [0, 1, 2, 7, 33, 129, 1000, 4097, 10_007]
    views = [[t[a:b] for a, b in zip(cuts, cuts[1:])] for t in pieces]
    exact_adamw_(*views, step=7, **HYPER)
    for a, b in zip(whole, pieces):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_fast_formula_is_torch_adamw_bit_for_bit_on_cpu():
    """What megatron-core's fallback optimizer (torch.optim.AdamW) computes for the same shard tensors."""
    tensors = [_adam_inputs(n, i) for i, n in enumerate([64, 1000, 4097])]
    ours = [[ts[0].clone(), None, torch.zeros_like(ts[0]), torch.zeros_like(ts[0])] for ts in tensors]
    ref_params = [torch.nn.Parameter(ts[0].clone()) for ts in tensors]
    opt = torch.optim.AdamW(ref_params, lr=HYPER["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(1, 4):
        grads = [ts[1] * step for ts in tensors]
        for p, g in zip(ref_params, grads):
            p.grad = g.clone()
        opt.step()
        torch_adamw_([o[0] for o in ours], grads, [o[2] for o in ours], [o[3] for o in ours], step=step, fused=False,
                     **HYPER)
    for o, p in zip(ours, ref_params):
        assert torch.equal(o[0], p.detach())
        assert torch.equal(o[2], opt.state[p]["exp_avg"]) and torch.equal(o[3], opt.state[p]["exp_avg_sq"])


def test_exact_formula_is_adamw():
    p, g, m, v = _adam_inputs(5000, 3)
    a = [t.clone() for t in (p, g, m, v)]
    b = [t.clone() for t in (p, g, m, v)]
    for step in (1, 2, 3):
        exact_adamw_([a[0]], [a[1]], [a[2]], [a[3]], step=step, **HYPER)
        torch_adamw_([b[0]], [b[1]], [b[2]], [b[3]], step=step, fused=False, **HYPER)
    assert not torch.equal(a[0], b[0])  # a different rounding order ...
    assert torch.allclose(a[0], b[0], rtol=0, atol=1e-6)  # ... of the same update
    assert torch.allclose(a[3], b[3], rtol=1e-5, atol=0)


@needs_gpu
@pytest.mark.gpu
def test_exact_formula_gives_the_same_bits_on_gpu_and_cpu():
    p, g, m, v = _adam_inputs(1_000_003, 4)
    cpu = [t.clone() for t in (p, g, m, v)]
    gpu = [t.cuda() for t in (p, g, m, v)]
    for step in (1, 2, 3):
        exact_adamw_([cpu[0]], [cpu[1]], [cpu[2]], [cpu[3]], step=step, **HYPER)
        exact_adamw_([gpu[0]], [gpu[1]], [gpu[2]], [gpu[3]], step=step, **HYPER)
    for a, b in zip(cpu, gpu):
        assert torch.equal(a.view(torch.int32), b.cpu().view(torch.int32))


def _chunked_adam(numerics="fast", tiers=None):
    plan = plan_chunks([(0, _shard([300, 70, 1000, 5, 640]))], capacity=512)
    store = ChunkStore(plan, torch.device("cpu"))
    store.allocate(tiers or [DEVICE] * len(plan.chunks))
    mains = [torch.empty(0) for _ in range(5)]
    groups = [{"params": mains[:3], "lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8,
               "wd_mult": 1.0},
              {"params": mains[3:], "lr": 1e-3, "weight_decay": 0.0, "betas": (0.9, 0.95), "eps": 1e-8,
               "wd_mult": 0.0}]
    group_of = {0: 0, 1: 0, 2: 0, 3: 1, 4: 1}
    numel = plan.chunks[-1].end
    grad_buffer = torch.randn(numel, generator=torch.Generator().manual_seed(5)) * 1e-2
    param_buffer = torch.randn(numel, generator=torch.Generator().manual_seed(6)).bfloat16()
    layout = [{} for _ in plan.chunks]
    for c in plan.chunks:
        for s in c.spans:
            layout[c.index].setdefault(group_of[s.key], []).append((s, mains[s.key]))
    opt = ChunkedAdam(groups, store, layout, [grad_buffer[c.start:c.end] for c in plan.chunks],
                      [param_buffer[c.start:c.end] for c in plan.chunks], numerics)
    for c in plan.chunks:
        store.row(c.index, "param").copy_(param_buffer[c.start:c.end])
        for s in c.spans:
            store.bind_main_param(c.index, s, mains[s.key])
            store.bind_state(c.index, s, opt.state[mains[s.key]])
    return opt, store, param_buffer


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_any_layout_gives_the_same_step(numerics):
    n = 4
    runs = []
    for tiers in ([DEVICE] * n, [HOST] * n, [DEVICE, HOST, DEVICE, HOST]):
        opt, store, params = _chunked_adam(numerics, tiers)
        for step in range(3):
            opt.step()
            store.move(step % n, HOST if store.tiers[step % n] == DEVICE else DEVICE)  # between steps
        runs.append((params.clone(), [t.clone() for t in store.data]))
    for params, data in runs[1:]:
        assert torch.equal(params, runs[0][0])
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(data, runs[0][1]))
    assert not torch.equal(runs[0][0], _chunked_adam(numerics)[2])  # the parameters did move


def test_step_count_is_saved_and_restored_by_the_optimizer():
    opt, store, _ = _chunked_adam()
    for _ in range(3):
        opt.step()
    sd = opt.state_dict()
    assert {g["step"] for g in sd["param_groups"]} == {3}
    assert all(float(s["step"]) == 3 for s in sd["state"].values())
    fresh, fresh_store, _ = _chunked_adam()
    saved = {i: {k: v.clone() for k, v in s.items()} for i, s in sd["state"].items()}
    fresh.load_state_dict({"state": saved, "param_groups": sd["param_groups"]})
    assert fresh.step_count == 3
    assert all(torch.equal(fresh_store.row(c.index, "exp_avg"), store.row(c.index, "exp_avg"))
               for c in store.chunks)
    # the step also comes from per-parameter steps alone (a checkpoint of torch's Adam)
    groups = [{k: v for k, v in g.items() if k != "step"} for g in sd["param_groups"]]
    again, _, _ = _chunked_adam()
    again.load_state_dict({"state": saved, "param_groups": groups})
    assert again.step_count == 3
    with pytest.raises(ValueError, match="several step counts"):
        again.load_state_dict({"state": {0: {**saved[0], "step": torch.tensor(2.0)}, 1: saved[1]},
                               "param_groups": groups})


# --- the policy -------------------------------------------------------------------------------------------

MiB = 2**20


def _reading(free_for_chunks: int, device_chunk_bytes: int, margin: int = 10 * MiB):
    """A device with room for ``free_for_chunks`` bytes of chunks beyond the margin and 100 MiB of model data."""
    return MemoryReading(margin + 100 * MiB + free_for_chunks, 100 * MiB + device_chunk_bytes, 0, 0)


def _drive(policy, sizes, free_by_iter, start_k):
    k, actions = start_k, []
    for it, free in enumerate(free_by_iter, 1):
        d = policy.decide(it, _reading(free, sum(sizes[:k])), sizes, k)
        k = d.device_chunks
        actions.append((d.action, k))
    return actions


def test_auto_evicts_at_once_and_only_what_covers_the_deficit():
    sizes = [4 * MiB] * 10
    policy = AutoPolicy(margin=10 * MiB, patience=2, cooldown=3)
    d = policy.decide(1, _reading(22 * MiB, 40 * MiB), sizes, 10)  # 18 MiB short: 5 chunks of 4
    assert (d.action, d.device_chunks, d.headroom) == ("evict", 5, -18 * MiB)
    # activations grow: the peak of non-model data counts against the budget too
    # 150 MiB device, 10 margin, 120 model data (20 of it chunks), 30 of activations: 10 MiB short
    d = policy.decide(2, MemoryReading(150 * MiB, 120 * MiB, 30 * MiB, 5 * MiB), sizes, 5)
    assert (d.action, d.device_chunks, d.headroom) == ("evict", 2, -10 * MiB)


def test_auto_promotes_after_patience_not_during_cooldown_and_no_more_than_fits():
    sizes = [4 * MiB] * 10
    policy = AutoPolicy(margin=10 * MiB, patience=3, cooldown=4)
    # iteration 1: short -> evict to 2 chunks; then room for everything, but the cooldown holds until 6
    actions = _drive(policy, sizes, [8 * MiB] + [40 * MiB] * 8, 10)
    assert actions[0] == ("evict", 2)
    assert [a for a, _ in actions[1:5]] == ["hold"] * 4  # cooldown (4 steps after the eviction)
    assert actions[5] == ("promote", 10)  # iteration 6: patience (3 steps of room) and cooldown both satisfied
    # room that shrinks during the streak: promote only what the smallest headroom holds
    policy = AutoPolicy(margin=10 * MiB, patience=3, cooldown=0)
    actions = _drive(policy, sizes, [20 * MiB, 13 * MiB, 30 * MiB], 0)
    assert actions == [("hold", 0), ("hold", 0), ("promote", 3)]


def test_auto_does_not_bounce_on_oscillating_memory():
    sizes = [4 * MiB] * 10
    policy = AutoPolicy(margin=10 * MiB, patience=2, cooldown=3)
    free = [40 * MiB, 40 * MiB] + [12 * MiB, 40 * MiB] * 6  # tight every other step
    actions = _drive(policy, sizes, free, 10)
    moves = [a for a, _ in actions if a != "hold"]
    assert moves == ["evict"], actions  # evicted once, never promoted back into the oscillation
    assert actions[-1][1] == 3
    # and the same readings give the same schedule
    assert _drive(AutoPolicy(margin=10 * MiB, patience=2, cooldown=3), sizes, free, 10) == actions


def test_static_policy_holds_its_layout():
    policy = StaticPolicy(4)
    assert policy.decide(1, None, [1] * 8, 4).device_chunks == 4
    assert policy.decide(9, _reading(0, 10**9), [1] * 8, 4).action == "hold"


# --- the probes -------------------------------------------------------------------------------------------

class FakeCuda:
    """torch.cuda's allocator statistics, scripted."""

    def __init__(self, allocated, peaks):
        self.allocated, self.peaks = allocated, list(peaks)

    def synchronize(self):
        pass

    def memory_allocated(self):
        return self.allocated

    def max_memory_allocated(self):
        return self.peaks[0]

    def reset_peak_memory_stats(self):
        self.peaks = self.peaks[1:] or self.peaks

    def mem_get_info(self):
        return (0, 80 * 2**30)


def test_cuda_probe_reads_model_data_and_phase_peaks():
    cuda = FakeCuda(allocated=30 * 2**30, peaks=[0, 70 * 2**30, 36 * 2**30])
    probe = CudaProbe(cuda=cuda)
    probe.begin_step(1)  # first reset drops the stale peak
    probe.end_phase("fwd_bwd")
    probe.end_phase("update")
    r = probe.reading(1, Accounting(0, 0, 0))
    assert r == MemoryReading(80 * 2**30, 30 * 2**30, 40 * 2**30, 6 * 2**30)
    assert r.peak_non_model == 40 * 2**30
    assert CudaProbe(capacity=24 * 2**30, cuda=cuda).capacity == 24 * 2**30  # MP_GPU_MEMORY_GB wins


def test_scripted_probe_follows_its_script(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"device_fraction": {"3": 0.4, "7": 1.0}}))
    probe = ScriptedProbe.from_file(path, margin=10)
    acc = Accounting(device_chunk_bytes=600, total_chunk_bytes=1000, static_model_bytes=50)
    headroom = [(lambda r: r.capacity - 10 - r.model_bytes - r.peak_non_model)(probe.reading(i, acc)) for i in (1, 3, 6, 7)]
    assert headroom == [400, -200, -200, 400]
    for bad in ('{"device_fraction": {"0": 1}}', '{"device_fraction": {"2": 1.5}}', "[1]", "nope"):
        path.write_text(bad)
        with pytest.raises(UserError, match="MP_OFFLOAD_PROBE_SCRIPT"):
            ScriptedProbe.from_file(path, margin=0)


def _near_sqrt_midpoints(n: int, seed: int) -> torch.Tensor:
    """float32 values whose square roots lie next to a rounding midpoint: x = fl(((y + next(y)) / 2)^2).

    Any square root that is not correctly rounded (a float32 reciprocal-root estimate refined by Newton
    steps, as some CPU kernels use) misses a good share of these; uniform values expose it less often.
    """
    y = torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 0.5 + 1e-4
    mid = (y.double() + torch.nextafter(y, torch.tensor(1.0)).double()) / 2
    return (mid * mid).float()


def test_square_root_is_correctly_rounded_on_this_cpu():
    """The exact formula's square root equals IEEE's (numpy's float32 sqrt is correctly rounded everywhere),
    on inputs chosen next to rounding midpoints, whichever x86 CPU or kernel torch picked here."""
    x = torch.cat([_near_sqrt_midpoints(4096, 3), torch.rand(4096, generator=torch.Generator().manual_seed(4))])
    ieee = torch.from_numpy(np.sqrt(x.numpy()))
    assert torch.equal(correctly_rounded_sqrt(x), ieee)
    assert correctly_rounded_sqrt(x).dtype == torch.float32


def test_exact_formula_is_correctly_rounded_step_by_step():
    """Each step of the exact formula is one IEEE operation: check against float64 rounded once per step.

    The second moments are uniform in [0, 1) and next to square-root midpoints, where torch's own float32
    sqrt is 1 ulp off for about a fifth of the values on some CPUs (AMD EPYC, torch 2.13). Half the
    parameters start at zero, so the update is the whole new value and a 1-ulp denominator shows in it.
    """
    p, g, m, _ = _adam_inputs(514, 7)
    p[257:] = 0
    v = torch.cat([torch.rand(257, generator=torch.Generator().manual_seed(8)), _near_sqrt_midpoints(257, 9)])
    a = [t.clone() for t in (p, g, m, v)]
    exact_adamw_([a[0]], [a[1]], [a[2]], [a[3]], step=5, **HYPER)
    f = lambda x: x.double().float().double()  # noqa: E731 - round to float32
    lr, b1, b2, eps, wd = HYPER["lr"], HYPER["beta1"], HYPER["beta2"], HYPER["eps"], HYPER["weight_decay"]
    P, G, M, V = (t.double() for t in (p, g, m, v))
    P = f(P * f(torch.tensor(1 - lr * wd, dtype=torch.float64)))
    M = f(f(M * f(torch.tensor(b1).double())) + f(G * f(torch.tensor(1 - b1).double())))
    V = f(f(V * f(torch.tensor(b2).double())) + f(f(G * G) * f(torch.tensor(1 - b2).double())))
    D = f(f(f(V.sqrt()) * f(torch.tensor(1 / math.sqrt(1 - b2 ** 5)).double())) + f(torch.tensor(eps).double()))
    P = f(P - f(f(M / D) * f(torch.tensor(lr / (1 - b1 ** 5)).double())))
    assert torch.equal(a[0].double(), P) and torch.equal(a[2].double(), M) and torch.equal(a[3].double(), V)
