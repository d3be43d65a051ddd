"""No process outlives its run (issue 34): after a SIGKILL to the launcher's process group, the ranks die
(PR_SET_PDEATHSIG), and so does the helper process megatron-core's checkpoint writer keeps for each rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.training_helpers import REPO, pretrain_args


def _launch(args: list[str], env: dict, **popen) -> subprocess.Popen:
    script = os.path.join(REPO, "examples", "llama3_1", "run_mcore_llama3_1.sh")
    return subprocess.Popen(["bash", script, *args], env={**os.environ, "PYTHON": sys.executable, **env}, **popen)


# --- no process outlives its run ----------------------------------------------------------------------------

def _processes_of(launcher_pid: int) -> list[psutil.Process]:
    """Every process of the run the launcher started: each carries the launcher's pid in its environment."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != launcher_pid and p.environ().get("MP_LAUNCHER_PID") == str(launcher_pid):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@pytest.mark.slow
def test_a_sigkill_to_the_launchers_group_leaves_no_process_of_the_run(corpus, tmp_path):
    """The launcher in a session of its own (a terminal's job), SIGKILLed with its process group once the run has
    saved a checkpoint. The rank has a helper then: megatron-core's checkpoint writer serves its results queue
    from a spawned multiprocessing Manager (about 270 MB), which used to live on for good."""
    out = tmp_path / "out"
    args = pretrain_args(corpus, out, SAVE_INTERVAL="2", TRAIN_TOKENS_OR_ITERS=str(10**6 * 8 * 64))
    with open(tmp_path / "launcher.log", "w") as log:
        proc = _launch(args, {}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    left: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoint" / "iter_0000002").is_dir():
            assert proc.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint after 300 s"
            time.sleep(0.5)
        run = _processes_of(proc.pid)
        ranks = [p for p in run if p.ppid() == proc.pid]
        helpers = [p for p in run if ranks and p.ppid() == ranks[0].pid and "multiprocessing.spawn" in " ".join(p.cmdline())]
        assert len(ranks) == 1 and helpers, [(p.pid, p.ppid(), p.cmdline()[:4]) for p in run]

        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60  # a process dies of its parent's death within moments; this is the limit
        while _processes_of(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _processes_of(proc.pid)
        assert not left, [(p.pid, p.ppid(), " ".join(p.cmdline())[:120]) for p in left]
    finally:
        for p in [*_processes_of(proc.pid), *left]:  # never leave this test's processes behind
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
