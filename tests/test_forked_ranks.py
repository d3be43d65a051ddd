"""A CPU job's ranks (ENV=cpu, or ENV=dlc on one node or several) are forked from a fork server that imported torch and
megatron-core once (runtime/launch.py, ``forked_ranks``), under torchrun's own agent. Each must be what the
agent's fresh ``python -u -m megatron_patch train ...`` rank is: the launcher's environment and working folder as
they are now (not the fork server's, taken when it started), its output on the launcher's descriptors, unbuffered,
a session of its own, and no life beyond its launcher's. ``MP_LOCAL_START=spawn`` keeps the fresh interpreters (a
GPU always does), and both give the same run.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from megatron_patch.outputs.lock import live_ranks
from megatron_patch.runtime import scratch
from megatron_patch.runtime.distributed import free_port
from megatron_patch.runtime.launch import JobFailed, forked_ranks, run_torchrun
from tests.training_helpers import GBS, SEQ, launcher_args, make_corpus, pretrain_args, read_metrics

REPO = Path(__file__).resolve().parents[1]
TWO_RANKS = ["--standalone", "--nnodes=1", "--nproc_per_node=2", "-m", "unused"]  # the module is not run: the call is


def report_rank(folder: str) -> int:
    """A rank's view of itself, written to ``folder``; a line on stdout with no flush (``-u`` needs none)."""
    me = psutil.Process()
    facts = {"rank": os.environ["RANK"], "run_id": os.environ.get("TORCHELASTIC_RUN_ID"), "cwd": os.getcwd(),
             "probe": os.environ.get("MP_PROBE_SET_AFTER_THE_SERVER"), "pid": me.pid, "sid": os.getsid(0),
             "parent": me.ppid(), "parent_cmdline": " ".join(me.parent().cmdline())}
    Path(folder, f"rank{facts['rank']}.json").write_text(json.dumps(facts))
    sys.stdout.write(f"rank {facts['rank']} was here\n")
    return 0


def fail_on_rank_one() -> int:
    return 3 if os.environ["RANK"] == "1" else 0


def die_together(folder: str) -> int:
    """Rank 1 killed by SIGKILL (as by the kernel's OOM killer) and rank 0 ending a moment later with status 1 (as a
    rank whose peer went away does), once both have started."""
    Path(folder, f"rank{os.environ['RANK']}.ready").touch()
    while not all(Path(folder, f"rank{r}.ready").exists() for r in (0, 1)):
        time.sleep(0.001)
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.005)
    return 1


def report_signals(folder: str) -> int:
    import signal as signals

    handlers = {name: signals.getsignal(getattr(signals, name)) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")}
    shown = {name: h.name if isinstance(h, signals.Handlers) else h.__name__ for name, h in handlers.items()}
    shown["faulthandler"] = faulthandler.is_enabled()
    Path(folder, f"rank{os.environ['RANK']}.json").write_text(json.dumps(shown))
    return 0


@pytest.fixture(scope="module")
def fork_server():
    """The fork server, started before any test of this module captures this process's output or changes its
    environment: what a forked rank finds in it is stale by the time a test runs."""
    assert forked_ranks(), "this machine has a fork server and no CUDA device: ranks are forked here"


def _node_line() -> list[str]:
    """ENV=dlc's torchrun arguments for node 0 of a one-node job (cli/train.py ``_node_arguments``)."""
    return ["--nproc_per_node=2", "--nnodes=1", "--node_rank=0", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", "--rdzv_conf=timeout=30", "-m", "unused"]


@pytest.mark.parametrize("line", ["standalone", "node"])
def test_a_forked_rank_sees_the_launcher_as_it_is_now_and_has_a_session_of_its_own(fork_server, tmp_path, capfd,
                                                                                      monkeypatch, line):
    # after the fork server started: a forked rank must see these, as a fresh one would
    monkeypatch.setenv("MP_PROBE_SET_AFTER_THE_SERVER", "yes")
    monkeypatch.chdir(tmp_path)
    run_torchrun(TWO_RANKS if line == "standalone" else _node_line(), (report_rank, (str(tmp_path),)))
    facts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [f["rank"] for f in facts] == ["0", "1"] and facts[0]["run_id"] and facts[0]["run_id"] == facts[1]["run_id"]
    for f in facts:
        assert f["probe"] == "yes" and f["cwd"] == str(tmp_path), f
        assert f["sid"] == f["pid"], f  # a session of its own: a terminal's Ctrl-C reaches only the launcher
        assert f["parent"] != os.getpid() and "multiprocessing.forkserver" in f["parent_cmdline"], f
    out = capfd.readouterr().out  # this test's descriptor 1, not the one the fork server started with
    assert "rank 0 was here" in out and "rank 1 was here" in out, out


def test_a_forked_rank_s_status_fails_the_job_naming_it(fork_server):
    with pytest.raises(JobFailed) as failed:
        run_torchrun(TWO_RANKS, (fail_on_rank_one, ()))
    assert failed.value.code == 1
    assert str(failed.value).startswith("rank 1 (pid ") and "exited with status 3" in str(failed.value)


def test_a_forked_rank_killed_by_a_signal_is_named_not_the_rank_it_took_down(fork_server, tmp_path):
    """torch's agent for forked ranks reports one failed process, the first in local-rank order: rank 0, whose peer
    went away, hid rank 1's SIGKILL, which fresh ranks' agent names (and the one line with it: the kernel's OOM
    killer among the causes)."""
    with pytest.raises(JobFailed) as failed:
        run_torchrun(TWO_RANKS, (die_together, (str(tmp_path),)))
    assert failed.value.code == 1
    assert str(failed.value).startswith("rank 1 (pid ") and "was killed by SIGKILL (by hand, by the scheduler, or by " \
        "the kernel for want of memory)" in str(failed.value), str(failed.value)


def test_a_forked_rank_handles_the_agents_signals_as_a_fresh_rank_does(fork_server, tmp_path, monkeypatch):
    """A launcher started with SIGINT ignored (a script's `cmd &`, where the shell has no job control): torch's agent
    handles SIGINT there, so a fresh rank starts with Python's own handler and stops at the agent's SIGINT, while a
    forked rank kept the fork server's SIG_IGN and trained on until torch's SIGKILL 30 s later. And faulthandler,
    which torch's agent turns on around a forked rank, is on only where PYTHONFAULTHANDLER asks, as in a fresh rank
    (a SIGSEGV printed 40 lines of thread dumps above the launcher's one line)."""
    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")
    run_torchrun(TWO_RANKS, (report_signals, (str(tmp_path),)))
    assert json.loads((tmp_path / "rank1.json").read_text())["faulthandler"] is True
    monkeypatch.delenv("PYTHONFAULTHANDLER")
    script = f"""
import signal, sys
sys.path.insert(0, {str(REPO)!r})
signal.signal(signal.SIGINT, signal.SIG_IGN)
from megatron_patch.runtime.launch import forked_ranks, run_torchrun
from tests.test_forked_ranks import TWO_RANKS, report_signals
if __name__ == "__main__":
    assert forked_ranks()
    run_torchrun(TWO_RANKS, (report_signals, ({str(tmp_path)!r},)))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {
            "SIGINT": "default_int_handler", "SIGTERM": "SIG_DFL", "SIGHUP": "SIG_DFL", "SIGQUIT": "SIG_DFL",
            "faulthandler": False}


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "1", "RANK": "0"}, {"WORLD_SIZE": "2", "RANK": "1"}])
def test_a_dlc_node_without_a_gpu_forks_its_ranks(fork_server, env, tmp_path, monkeypatch):
    """ENV=dlc on a CPU node trains over gloo as ENV=cpu does, and its ranks are forked too, one node or several:
    Pai's command lines, which name it, started each rank as a fresh interpreter (8 imports of torch and
    megatron-core for its Qwen3 line)."""
    from megatron_patch.cli import train
    from megatron_patch.training.validation import resolve

    for suffix in (".bin", ".idx"):
        (tmp_path / f"corpus_text_document{suffix}").write_bytes(b"")
    argv = launcher_args(ENV="dlc", DATASET_PATH=str(tmp_path / "corpus_text_document"), TP="2",
                         OUTPUT_BASEPATH=str(tmp_path / "out"))
    node = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "GPUS_PER_NODE": "2"}
    for name, value in {**node, **env, train.LAUNCHER_PID: "", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(name, value)  # restored after: the launch sets some of them in this process
    cfg = resolve("llama3_1", argv, env={**node, **env})
    started = []
    monkeypatch.setattr(train, "run_torchrun", lambda args, forked: started.append((args, forked)))
    assert train._launch(cfg, train.launch_command(cfg, argv, here=False), argv, {}) == 0
    [(args, forked)] = started
    assert f"--nnodes={env['WORLD_SIZE']}" in args and "--standalone" not in args
    assert forked == (train._forked_rank_main, ("llama3_1", argv))


def test_mp_local_start_spawn_keeps_fresh_interpreters(monkeypatch):
    monkeypatch.setenv("MP_LOCAL_START", "spawn")
    assert not forked_ranks()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"), 200)


def _launch_seeing_the_ranks(args: list[str], out: Path, env: dict) -> tuple[subprocess.CompletedProcess, set[str]]:
    """The launcher run to its end, and how its ranks started, seen from their marks in ``out`` while they lived:
    'forked' (from the fork server) or 'fresh' (started by the launcher itself)."""
    script = REPO / "examples" / "llama3_1" / "run_mcore_llama3_1.sh"
    launcher = subprocess.Popen(["bash", str(script), *args], env={**os.environ, "PYTHON": sys.executable, **env},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = set()

    def look() -> None:
        while launcher.poll() is None:
            for mark in live_ranks(out):
                try:
                    parent = psutil.Process(int(mark.split()[1])).parent()
                    seen.add("forked" if "forkserver" in " ".join(parent.cmdline()) else "fresh")
                except (psutil.Error, AttributeError):
                    pass
            time.sleep(0.02)

    looking = threading.Thread(target=look)
    looking.start()
    stdout, stderr = launcher.communicate(timeout=480)
    looking.join()
    return subprocess.CompletedProcess(launcher.args, launcher.returncode, stdout, stderr), seen


@pytest.mark.slow
@pytest.mark.parametrize("env", ["cpu", "dlc"])
def test_forked_and_fresh_ranks_train_the_same_run(corpus, tmp_path, env):
    """TP=2 for three iterations, forked and as fresh interpreters (MP_LOCAL_START=spawn), on ENV=cpu and on a dlc
    node without a GPU: the same losses, bit for bit; the fresh ranks' command line is the one the launcher prints."""
    args = {"TP": "2", "TRAIN_TOKENS_OR_ITERS": str(3 * GBS * SEQ), "WARMUP_TOKENS_OR_ITERS": "0", "ENV": env}
    node = {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "GPUS_PER_NODE": "2"} if env == "dlc" else {}
    line = ("--nproc_per_node=2 --nnodes=1 --node_rank=0 --master_addr=127.0.0.1" if env == "dlc" else
            "--standalone --nnodes=1 --nproc_per_node=2")
    for start in ("forked", "fresh"):
        out = tmp_path / start
        proc, seen = _launch_seeing_the_ranks(pretrain_args(corpus, out, **args), out, {
            "MP_SAVE": "false", **node, **({"MP_LOCAL_START": "spawn"} if start == "fresh" else {})})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert seen == {start}, seen
        assert f"-m torch.distributed.run {line}" in proc.stdout and f"{REPO}/mpatch.py train" in proc.stdout
    losses = [[(r["iteration"], r["loss"]) for r in read_metrics(tmp_path / name)] for name in ("forked", "fresh")]
    assert len(losses[0]) == 3 and losses[0] == losses[1], losses


def _sigint_handler_name() -> str:
    import signal

    handler = signal.getsignal(signal.SIGINT)
    return getattr(handler, "__name__", str(handler))


def test_ctrl_c_while_the_fork_server_imports_leaves_it_quiet_and_its_children_interruptible():
    """Ctrl-C reaches the fork server too; landing while it imported torch, it printed a page of KeyboardInterrupt
    traceback around the command's one line ("interrupted"). The server ignores it while it imports, and what it
    forks still handles Ctrl-C as Python does."""
    import multiprocessing as mp

    from megatron_patch.runtime.launch import LOCAL_JOB_PRELOAD

    script = f"""
import multiprocessing as mp, sys
sys.path.insert(0, {str(REPO)!r})
from tests.test_forked_ranks import _sigint_handler_name
if __name__ == "__main__":
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload({LOCAL_JOB_PRELOAD[:1] + ["tests.ctrl_c_during_preload"] + LOCAL_JOB_PRELOAD[1:]!r})
    with ctx.Pool(1) as pool:
        print(pool.apply(_sigint_handler_name))
"""
    assert "forkserver" in mp.get_all_start_methods()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert done.returncode == 0 and done.stdout.split() == ["default_int_handler"], (done.stdout, done.stderr[-3000:])
    assert "KeyboardInterrupt" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_forked_ranks_end_when_the_launcher_alone_is_killed(corpus, tmp_path):
    """A SIGKILL to the launcher's process alone (the kernel's OOM killer picks one process): the fork server, armed
    against the launcher (fork_server_guard), ends, and the ranks, armed against the server, with it. Without the
    guard, multiprocessing's "alive" pipe, which every rank holds, kept the server and its ranks up for good. The
    launcher's resource tracker, left behind, unlinks what torch's process context made, without a word (it warned of
    "9 leaked semaphore objects" under the job's output). Its scratch folders in TMPDIR (multiprocessing's and
    torchrun's agent's) stay behind, and the next launch removes them: a pymp-* and a torchelastic_* piled up in
    /tmp per killed launch."""
    out = tmp_path / "out"
    # a TMPDIR short enough for the fork server's socket (a deep one sends multiprocessing's folder to /tmp itself:
    # test_runtime's test of a deep TMPDIR)
    scratch_base = Path(tempfile.mkdtemp(prefix="mp-scratch-test-", dir="/tmp"))
    args = pretrain_args(corpus, out, TP="2", TRAIN_TOKENS_OR_ITERS=str(10**6 * GBS * SEQ))
    script = REPO / "examples" / "llama3_1" / "run_mcore_llama3_1.sh"
    env = {**os.environ, "PYTHON": sys.executable, "MP_SAVE": "false", "TMPDIR": str(scratch_base)}
    stderr = open(tmp_path / "stderr", "w")
    launcher = subprocess.Popen(["bash", str(script), *args], env=env, stdout=subprocess.DEVNULL,
                                stderr=stderr, start_new_session=True)  # bash execs the launcher
    try:
        deadline = time.monotonic() + 240
        while len(live_ranks(out)) < 2:
            assert launcher.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        children = psutil.Process(launcher.pid).children()
        server = [p for p in children if "forkserver" in " ".join(p.cmdline())]
        tracker = [p for p in children if "resource_tracker import main" in " ".join(p.cmdline())]
        assert len(server) == len(tracker) == 1, [p.cmdline() for p in children]
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 60  # within moments; this is the limit
        while (live_ranks(out) or server[0].is_running() or tracker[0].is_running()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not live_ranks(out), "ranks outlived their launcher"
        assert not server[0].is_running() or server[0].status() == psutil.STATUS_ZOMBIE
        assert not tracker[0].is_running() or tracker[0].status() == psutil.STATUS_ZOMBIE
        stderr.close()
        assert "leaked semaphore" not in (tmp_path / "stderr").read_text(), (tmp_path / "stderr").read_text()
        left = sorted(p.name.split("-")[2] for p in scratch_base.iterdir() if p.name.startswith(scratch.PREFIX))
        assert left == ["pymp", "torchelastic"], left
        nothing = "import os\nfrom megatron_patch.runtime.launch import run_local\nrun_local(os.getpid, 2, timeout=120)\n"
        subprocess.run([sys.executable, "-c", nothing], env=env, cwd=REPO, check=True, timeout=180)
        assert not [p.name for p in scratch_base.iterdir() if p.name.startswith(scratch.PREFIX)]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        shutil.rmtree(scratch_base, ignore_errors=True)
