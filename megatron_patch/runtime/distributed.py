"""Process groups and seeds: NCCL on GPU, gloo on CPU, from the same call."""

from __future__ import annotations

import math
import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta

from megatron_patch.errors import UserError
from megatron_patch.lazy import LazyModule

# torch (1.1 s to import on 2 cores), megatron-core (3.4 s with torch) and transformers (0.6 s) are
# imported inside the functions that use them: `mpatch`, the launcher's checks and its dry run start without them.

# Imported on first use: ParallelLayout is needed by commands (conversion, --help) that never touch
# a process group, and importing torch costs seconds.
torch = LazyModule("torch", __name__)
dist = LazyModule("torch.distributed", __name__)
cpu_compat = LazyModule("megatron_patch.runtime.cpu_compat", __name__)


@dataclass(frozen=True)
class ParallelLayout:
    """How a model is split: tensor, pipeline, expert and expert-tensor parallel sizes.

    ``vp``: virtual pipeline stages (model chunks) per pipeline rank, None without interleaving. It
    changes how layers sit on ranks, not how many processes there are.
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None means "same as tp", as in megatron-core
    cp: int = 1
    vp: int | None = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def world_size(self) -> int:
        """Fewest processes that hold the layout: dense ranks and expert ranks must both fit."""

        return math.lcm(self.model_parallel_size, self.pp * self.ep * self.expert_tp)

    def __str__(self) -> str:
        etp = "" if self.etp is None else f" ETP={self.etp}"
        return (f"TP={self.tp} PP={self.pp} EP={self.ep}{etp}" + (f" CP={self.cp}" if self.cp > 1 else "")
                + (f" VP={self.vp}" if self.vp is not None else ""))


def device() -> torch.device:
    if torch.cuda.is_available() and not cpu_compat.is_enabled():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(timeout_minutes: float | None = None) -> None:
    """Join the job described by torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    A lone process with none of them set becomes a world of one on a free local port.
    ``timeout_minutes``: how long a collective (and joining the job) may wait for the other ranks
    before it raises instead of hanging; torch's default when None.
    """
    cpu_compat.enable()
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    extra = {} if timeout_minutes is None else {"timeout": timedelta(minutes=timeout_minutes)}
    store = _attempt_store(extra.get("timeout"))
    if store is not None:
        extra.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend=backend(), **extra)


def _attempt_store(timeout: timedelta | None):
    """torchrun's agent store, seen through a prefix of this restart attempt (None when not under an agent).

    torch 2.13's agents keep one store across restarts (static and c10d rendezvous alike), and its
    env:// rendezvous adds no per-attempt prefix. A restarted rank could then read the address a dead
    rank of the previous attempt had published and wait for it (seen: both restarted ranks stuck in
    gloo's connectFullMesh until the timeout). Every process group's keys live under the default store,
    so one prefix here covers megatron's groups too.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timeout or timedelta(minutes=30))
    return dist.PrefixStore(f"/mpatch/attempt_{attempt}", client)


def init_model_parallel(layout: ParallelLayout, seed: int = 1234, timeout_minutes: float | None = None) -> None:
    """Process groups for ``layout`` plus megatron's model-parallel RNG streams.

    Pipeline stage p is seeded with ``seed + 100 * p`` (Megatron-LM's rule): with one seed for all
    stages, a model initialised from scratch would start with the same weights in every stage.
    ``timeout_minutes`` applies to every group, megatron's included.
    """
    from megatron.core import parallel_state

    init_process_group(timeout_minutes)
    world = dist.get_world_size()
    if world % (layout.model_parallel_size) != 0:
        raise UserError(f"{world} processes cannot hold {layout}: the world size must be a multiple of TP*PP*CP")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        virtual_pipeline_model_parallel_size=layout.vp,
        **({} if timeout_minutes is None else {"distributed_timeout_minutes": timeout_minutes}),
    )
    set_seed(stage_seed(seed, parallel_state.get_pipeline_model_parallel_rank()))


def stage_seed(seed: int, pipeline_rank: int) -> int:
    return seed + 100 * pipeline_rank


def set_seed(seed: int) -> None:
    from megatron.core import tensor_parallel

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def move_to_device(chunks: list, device: torch.device) -> None:
    """Every parameter and buffer of the model chunks onto ``device`` (Megatron-LM's get_model does the same).

    megatron-core creates some on the host whatever the config says (the MoE router, the shared-expert
    gate); the mixed-precision optimizer then refuses them.
    """
    for chunk in chunks:
        chunk.to(device)
    stray = [name for chunk in chunks for name, t in [*chunk.named_parameters(), *chunk.named_buffers()]
             if t.device != device]
    if stray:
        raise RuntimeError(f"{len(stray)} tensors stayed off {device} after moving the model, e.g. {stray[0]}")
