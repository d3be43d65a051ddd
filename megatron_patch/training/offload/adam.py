"""AdamW over chunks on two tiers, with its own step counter.

Two update formulas:

- ``fast`` is torch's AdamW (``torch.optim.adam.adam`` with decoupled weight decay), called on the
  span views of each chunk: the fused kernel on a GPU, torch's fused CPU kernel for host chunks next
  to a GPU, and on a machine without one the single-tensor path that megatron-core's own fallback
  optimizer (``torch.optim.AdamW``) takes there. Each span has the length of the distributed
  optimizer's own parameter shard, so on CPU the result is megatron's, bit for bit.
- ``exact`` (``MP_OFFLOAD_NUMERICS=exact``) is the same AdamW written as single-rounding IEEE steps,
  one torch call each (multiply, add, square root, divide; scalars as multipliers computed in Python).
  The square root is taken in float64 and rounded once to float32, which is the correctly rounded
  float32 root (53 >= 2*24 + 2 bits, so the double rounding is harmless): torch's own float32 sqrt is
  not correctly rounded on every CPU (about 20% of uniform inputs are 1 ulp off on some AMD EPYC
  machines, whatever ATEN_CPU_CAPABILITY says), while CUDA's is. Nothing in it can be fused, contracted into an FMA or turned into a reciprocal differently on a CPU
  and a GPU, so a chunk updated on either tier gives the same bits, and any layout schedule gives the
  run it would have given with no offload. Slower (about ten passes over the state): for
  verification.

The step count is the optimizer's, not the tensors': bias correction uses ``step_count``, which is
saved in the checkpoint's param groups (where megatron's distributed optimizer keeps it for every
inner optimizer) and restored from there.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict

import torch
from torch.optim.adam import adam

from megatron_patch.training.offload.chunks import DEVICE, HOST, ChunkStore

NUMERICS = ("fast", "exact")


# float64 elements per block: on the host a 512 KiB temporary that stays in cache; on a GPU few launches
_SQRT_BLOCK = {"cpu": 1 << 16, "cuda": 1 << 24}


def correctly_rounded_sqrt(x: torch.Tensor) -> torch.Tensor:
    """IEEE square root of a float32 tensor, the same bits on every ISA and GPU.

    Taken block by block through one small float64 buffer: 2.8x faster on the host than converting the
    whole span at once (scripts/bench_adam_formula.py), and the temporary does not grow with the span.
    """
    flat = x.reshape(-1)
    out = torch.empty_like(flat)
    block = _SQRT_BLOCK.get(x.device.type, _SQRT_BLOCK["cuda"])
    buf = torch.empty(min(block, flat.numel()), dtype=torch.float64, device=x.device)
    for start in range(0, flat.numel(), block):
        end = min(start + block, flat.numel())
        wide = buf[:end - start]
        wide.copy_(flat[start:end])
        wide.sqrt_()
        out[start:end].copy_(wide)
    return out.view_as(x)


def exact_adamw_(params, grads, exp_avgs, exp_avg_sqs, *, step: int, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay: float) -> None:
    """AdamW in single-rounding steps; identical bits on every device and for every tensor length."""
    decay = 1.0 - lr * weight_decay
    step_size = lr / (1.0 - beta1 ** step)
    inv_bc2_sqrt = 1.0 / math.sqrt(1.0 - beta2 ** step)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        if weight_decay != 0:
            p.mul_(decay)
        m.mul_(beta1)
        m.add_(torch.mul(g, 1.0 - beta1))
        v.mul_(beta2)
        v.add_(torch.mul(torch.mul(g, g), 1.0 - beta2))
        denom = correctly_rounded_sqrt(v)
        denom.mul_(inv_bc2_sqrt)
        denom.add_(eps)
        update = torch.div(m, denom)
        update.mul_(step_size)
        p.sub_(update)


def torch_adamw_(params, grads, exp_avgs, exp_avg_sqs, *, step: int, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay: float, fused: bool) -> None:
    """torch's AdamW on these tensors (single-tensor path, or the fused kernel of their device)."""

    device = params[0].device
    steps = [torch.tensor(float(step - 1), dtype=torch.float32, device=device if fused else "cpu")
             for _ in params]
    adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=False, fused=fused, capturable=False,
         differentiable=False, decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
         weight_decay=weight_decay, eps=eps, maximize=False)


class ChunkedAdam(torch.optim.Optimizer):
    """The distributed optimizer's inner optimizer when its state lives in chunks.

    ``param_groups`` are megatron's (the scheduler sets lr and weight decay in them); ``state[p]`` holds
    views into the chunk store, so megatron's checkpoint code reads and writes the chunks directly.
    ``step()`` updates every chunk where it lies and writes the new parameters into the DDP parameter
    buffer (one copy per chunk), ready for megatron's parameter all-gather.
    """

    def __init__(self, param_groups: list[dict], store: ChunkStore, layout: list, grad_views: list,
                 param_views: list, numerics: str = "fast"):
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
        first = param_groups[0]
        super().__init__(param_groups, {k: v for k, v in first.items() if k != "params"})
        for g in self.param_groups:
            if g.get("amsgrad") or g.get("maximize"):
                raise ValueError("the chunked optimizer implements AdamW without amsgrad/maximize")
        self.store = store
        # layout[i]: per param group, the (span, main param) pairs of chunk i
        self.layout = layout
        self.grad_views = grad_views  # per chunk: fp32 gradients in the DDP buffer (device)
        self.param_views = param_views  # per chunk: parameters in the DDP buffer (device, param dtype)
        self.numerics = numerics
        self.step_count = 0
        self._staging: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.timing = None  # dict of seconds per phase when measured (set by the controller)
        self.staged_bytes = 0

    # --- the update ---------------------------------------------------------------------------------

    def _formula(self, tier: str, device: torch.device):
        if self.numerics == "exact":
            return exact_adamw_
        # Next to a GPU: its fused kernel on the device, torch's fused CPU kernel on the host. Without
        # one, both tiers take torch's default CPU path (what megatron's fallback AdamW runs).
        fused = self.store.device.type == "cuda"

        def run(params, grads, exp_avgs, exp_avg_sqs, **kw):
            torch_adamw_(params, grads, exp_avgs, exp_avg_sqs, fused=fused, **kw)

        return run

    def _staging_for(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host buffers for a host chunk's gradients (fp32) and its parameters in the param dtype."""
        if index not in self._staging:
            chunk = self.store.chunks[index]
            pin = self.store.pin_host
            grad = torch.empty(chunk.capacity, dtype=torch.float32, pin_memory=pin)
            param = torch.empty(chunk.capacity, dtype=self.param_views[index].dtype, pin_memory=pin)
            self._staging[index] = (grad, param)
        return self._staging[index]

    def _update_chunk(self, index: int, grads: torch.Tensor, step: int) -> None:
        store = self.store
        tier = store.tiers[index]
        formula = self._formula(tier, store.data[index].device)
        chunk = store.chunks[index]
        for group_index, pairs in self.layout[index].items():
            group = self.param_groups[group_index]
            beta1, beta2 = group["betas"]
            params, g_views, m_views, v_views = [], [], [], []
            for span, main in pairs:
                off = span.start - chunk.start
                params.append(main)
                g_views.append(grads[off: off + span.numel])
                state = self.state[main]
                m_views.append(state["exp_avg"])
                v_views.append(state["exp_avg_sq"])
            formula(params, g_views, m_views, v_views, step=step, lr=group["lr"], beta1=beta1, beta2=beta2,
                    eps=group["eps"], weight_decay=group["weight_decay"])

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over all chunks; the updated parameters are written to the DDP buffer."""
        if closure is not None:
            raise ValueError("the chunked optimizer takes no closure")
        store = self.store
        step = self.step_count + 1
        timing = defaultdict(float) if self.timing is not None else None
        cuda = store.device.type == "cuda"

        def clock(name, since):
            if timing is not None:
                if cuda:
                    torch.cuda.synchronize()
                timing[name] += time.perf_counter() - since
            return time.perf_counter()

        host = [i for i, t in enumerate(store.tiers) if t == HOST]
        device = [i for i, t in enumerate(store.tiers) if t == DEVICE]
        staged = 0
        t = time.perf_counter()
        # Host chunks' gradients start their trip first, so the copies overlap the device updates.
        for i in host:
            grad_stage, _ = self._staging_for(i)
            n = store.chunks[i].numel
            grad_stage[:n].copy_(self.grad_views[i], non_blocking=cuda)
            staged += n * 4
        t = clock("d2h_s", t)
        for i in device:
            self._update_chunk(i, self.grad_views[i], step)
            self.param_views[i].copy_(store.row(i, "param"))
        t = clock("device_adam_s", t)
        if host and cuda:
            torch.cuda.current_stream().synchronize()  # the gradients are on the host now
        for i in host:
            grad_stage, param_stage = self._staging_for(i)
            n = store.chunks[i].numel
            self._update_chunk(i, grad_stage[:n], step)
            param_stage[:n].copy_(store.row(i, "param"))  # cast on the host: half the bytes to copy back
            t = clock("cpu_adam_s", t)
            self.param_views[i].copy_(param_stage[:n], non_blocking=cuda)
            staged += n * param_stage.element_size()
            t = clock("h2d_s", t)
        self.step_count = step
        for group in self.param_groups:
            group["step"] = step
        self.staged_bytes = staged
        self.timing = dict(timing) if timing is not None else None

    # --- state for megatron's checkpoint code ---------------------------------------------------------

    def state_dict(self) -> dict:
        """torch's layout (state by parameter index, groups with their indices) plus the step count in
        every group, where megatron's distributed optimizer stores it for any inner optimizer."""
        index, groups = {}, []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index.setdefault(id(p), len(index)) for p in group["params"]]
            packed["step"] = self.step_count
            groups.append(packed)
        params = [p for g in self.param_groups for p in g["params"]]
        state = {}
        for i, p in enumerate(params):
            s = self.state.get(p)
            if s:
                state[i] = {"exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"],
                            "step": torch.tensor(float(self.step_count))}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Hyperparameters and step count from ``state_dict``; exp_avg/exp_avg_sq copied into the chunks."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"{len(saved_groups)} saved param groups for {len(self.param_groups)}")
        steps = {int(g["step"]) for g in saved_groups if g.get("params") and "step" in g}
        if not steps:
            steps = {int(float(s["step"])) for s in state_dict["state"].values() if "step" in s}
        if len(steps) > 1:
            raise ValueError(f"saved optimizer state has several step counts: {sorted(steps)}")
        for mine, saved in zip(self.param_groups, saved_groups):
            for k, v in saved.items():
                if k != "params":
                    mine[k] = v
        params = [p for g in self.param_groups for p in g["params"]]
        for i, saved in state_dict["state"].items():
            live = self.state[params[int(i)]]
            for name in ("exp_avg", "exp_avg_sq"):
                if name in saved and saved[name].data_ptr() != live[name].data_ptr():
                    live[name].copy_(saved[name])
        self.step_count = steps.pop() if steps else 0
        for group in self.param_groups:
            group["step"] = self.step_count

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # gradients are read from the DDP buffer, which megatron zeroes
