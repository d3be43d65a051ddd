"""The CPU runtime layer: megatron-core's TP/PP/DP/EP paths, optimizer and checkpoints on gloo.

Every multi-rank case runs in spawned local processes (``run_local``), never in the pytest process,
so the CUDA redirections of ``cpu_compat`` stay out of the other tests. Each layout is compared with
a one-process TP=1 reference built from the same checkpoint: same losses, same gradients (every
parameter, gathered back to full shape), same training trajectory.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_patch.checkpoint_files.layout import torch_dist_problem
from megatron_patch.checkpoint_files.torch_dist import TorchDistReader
from megatron_patch.errors import UserError
from megatron_patch.runtime import ParallelLayout, scratch
from megatron_patch.runtime.launch import run_local
from tests import runtime_helpers as rh

TIMEOUT = 300
STEPS = 4
VARIANTS = ((False, False), (False, True), (True, False), (True, True))  # (distributed optimizer, overlap)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _close(actual, expected, atol, rtol=0.0, what=""):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


def _dp_losses(results, key=lambda r: r["losses"]):
    """Losses of the global batch in order: last-stage, TP-rank-0 ranks, by data-parallel rank."""
    ranks = sorted((r for r in results if r["last_stage"] and r["tp_rank"] == 0), key=lambda r: r["dp_rank"])
    return [x for r in ranks for x in key(r)]


def _assert_grads_match(grads: dict, reference: dict, what: str) -> None:
    assert set(grads) == set(reference), f"{what}: parameters differ: {set(grads) ^ set(reference)}"
    for name, ref in reference.items():
        assert ref.abs().max() > 0, f"reference gradient of {name} is all zero"
        torch.testing.assert_close(grads[name], ref, atol=1e-6, rtol=1e-4, msg=lambda m: f"{what} {name}: {m}")


# --- references ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dense_ref(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("dense") / "ref")
    ref = run_local(rh.dense_reference_worker, 1, ckpt, timeout=TIMEOUT)[0]
    assert len(ref["losses"]) == rh.NUM_MICROBATCHES
    assert all(4.0 < loss < 5.5 for loss in ref["losses"]), ref["losses"]  # ~ln(128) at init
    return dict(ref, ckpt=ckpt)


@pytest.fixture(scope="module")
def moe_ref(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("moe") / "ref")
    ref = run_local(rh.moe_reference_worker, 1, ckpt, timeout=TIMEOUT)[0]
    assert any(".local_experts.3." in k for k in ref["grads"])
    return dict(ref, ckpt=ckpt)


@pytest.fixture(scope="module")
def train_ref(dense_ref):
    res = run_local(rh.train_worker, 1, ParallelLayout(), dense_ref["ckpt"], ((False, False),), STEPS,
                    timeout=TIMEOUT)[0]
    return res["runs"][(False, False)]


# --- gloo ------------------------------------------------------------------------------------------

def test_gloo_has_the_collectives_megatron_uses():
    """The layer redirects no torch collective: this is what it relies on gloo to do itself, plus
    its uneven all-gather for megatron's ``_gather_along_first_dim``."""
    res = run_local(rh.gloo_collectives_worker, 2, timeout=TIMEOUT)
    for rank, r in enumerate(res):
        assert r["backend"] == "gloo"
        # inputs [0,1,2,3]+rank summed over ranks 0,1 = [1,3,5,7]; rank r keeps its half.
        assert r["reduce_scatter_tensor"].tolist() == [[1.0, 3.0], [5.0, 7.0]][rank]
        assert r["all_gather_into_tensor"].tolist() == [0.0, 0.0, 1.0, 1.0]
        a, b = r["coalesced_reduce_scatter"]
        assert a.tolist() == [[1.0, 3.0], [5.0, 7.0]][rank] and b.tolist() == [3.0]
        # rank r receives (r+1+j) rows of value 10*j + r from each rank j.
        expected = [float(10 * j + rank) for j in range(2) for _ in range(j + 1 + rank)]
        assert r["all_to_all_uneven"].tolist() == expected
        assert r["megatron_uneven_gather"].tolist() == [0.0, 1.0, 1.0]
        assert r["megatron_uneven_reduce_scatter"].shape == (rank + 1, 2)
        assert r["megatron_uneven_reduce_scatter"].eq(3.0).all()


def test_a_local_job_started_inside_a_torchrun_rank_forms_its_own_world(monkeypatch):
    """A training rank asks run_local for its model's shape: the helper must not take the rank's torchrun agent
    variables for its own, or it waits for the agent's store at its own address (hung 30 minutes, seen in
    a run with MP_EVAL_TASKS)."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    res = run_local(rh.world_worker, 2, timeout=90)
    assert res == [(0, 2), (1, 2)]


# --- 1. forward/backward through the pipeline schedules -----------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("layout,use_ddp", [
    pytest.param(ParallelLayout(tp=2), False, id="tp2"),
    pytest.param(ParallelLayout(pp=2), False, id="pp2"),
    pytest.param(ParallelLayout(), True, id="dp2-ddp"),
])
def test_forward_backward_matches_tp1(dense_ref, layout, use_ddp):
    res = run_local(rh.fwd_bwd_worker, 2, layout, dense_ref["ckpt"], use_ddp, timeout=TIMEOUT)
    _close(_dp_losses(res), dense_ref["losses"], atol=1e-5, what="micro-batch losses")

    grads: dict[str, torch.Tensor] = {}
    for r in res:
        if r["grads"] is not None:
            assert not set(grads) & set(r["grads"]), "two stages returned the same parameter"
            grads.update(r["grads"])
    if layout.pp > 1 and not use_ddp:
        # Tied embeddings without DDP: the first stage holds the input-embedding part of the
        # gradient, the last stage's output-layer copy the rest; megatron's finalize step sums them.
        grads["embedding.word_embeddings.weight"] = grads["embedding.word_embeddings.weight"] + grads.pop("output_layer.weight")
    _assert_grads_match(grads, dense_ref["grads"], str(layout))


# --- 2. MoE with expert parallelism ------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("layout,world", [
    pytest.param(ParallelLayout(ep=2), 2, id="ep2"),
    pytest.param(ParallelLayout(tp=2, ep=2), 4, id="ep2-tp2"),
])
def test_moe_expert_parallel_matches_tp1(moe_ref, layout, world):
    dispatchers = ("allgather", "alltoall")
    res = run_local(rh.moe_worker, world, layout, moe_ref["ckpt"], dispatchers, timeout=TIMEOUT)
    assert sorted({r["ep_rank"] for r in res}) == [0, 1]
    for dispatcher in dispatchers:
        losses = _dp_losses(res, key=lambda r: r["results"][dispatcher]["losses"])
        _close(losses, moe_ref["losses"], atol=1e-5, what=f"{dispatcher} losses")
        for r in res:
            out = r["results"][dispatcher]
            # Each rank holds 2 of the 4 experts per layer, and every one of them received tokens.
            assert len(out["local_expert_grad_sums"]) == 2 * 2 * 2  # layers x local experts x (fc1, fc2)
            assert all(v > 0 for v in out["local_expert_grad_sums"].values()), out["local_expert_grad_sums"]
            where = {k: r[k] for k in ("tp_rank", "ep_rank", "dp_rank")}
            _assert_grads_match(out["grads"], moe_ref["grads"], f"{layout} {dispatcher} {where}")


# --- 3. megatron DDP + optimizer -------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    pytest.param(ParallelLayout(tp=2), id="tp2"),
    pytest.param(ParallelLayout(pp=2), id="pp2"),
    pytest.param(ParallelLayout(), id="dp2"),
])
def test_optimizer_steps_match_tp1(dense_ref, train_ref, layout):
    res = run_local(rh.train_worker, 2, layout, dense_ref["ckpt"], VARIANTS, STEPS, timeout=TIMEOUT)
    ref_means = [sum(s["losses"]) / len(s["losses"]) for s in train_ref]
    ref_norms = [s["grad_norm"] for s in train_ref]
    assert ref_norms[0] > rh.CLIP_GRAD, "the first step must be clipped for this test to mean anything"
    for variant in VARIANTS:
        what = f"{layout} distributed_optimizer={variant[0]} overlap_grad_reduce={variant[1]}"
        means = [sum(_dp_losses(res, key=lambda r, i=i: r["runs"][variant][i]["losses"])) / rh.NUM_MICROBATCHES
                 for i in range(STEPS)]
        for r in res:
            hist = r["runs"][variant]
            assert all(s["ok"] for s in hist), what
            norms = [s["grad_norm"] for s in hist]
            assert all(math.isfinite(n) and n > 0 for n in norms), (what, norms)
            _close(norms, ref_norms, atol=0, rtol=1e-5, what=f"{what}: grad norms")
            for s in hist:  # clipping leaves the gradient at norm min(norm, clip_grad)
                _close(s["clipped_norm"], min(s["grad_norm"], rh.CLIP_GRAD), atol=1e-5, what=f"{what}: clipped norm")
        assert all(b < a for a, b in zip(means, means[1:])), (what, means)
        assert means[-1] < means[0] - 0.1, (what, means)
        _close(means, ref_means, atol=2e-5, what=f"{what}: mean loss per step")


# --- 4. dist_checkpointing across layouts ----------------------------------------------------------

@pytest.mark.slow
def test_checkpoint_tp2_restores_at_tp1_and_dp2(dense_ref, tmp_path):
    ckpt = str(tmp_path / "tp2")
    saved = run_local(rh.save_checkpoint_worker, 2, ParallelLayout(tp=2), dense_ref["ckpt"], ckpt, 2, timeout=TIMEOUT)
    files = set(os.listdir(ckpt))
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= files, files
    # megatron's common state: common.pt up to megatron-core 0.16, an object in the .distcp files from 0.19.
    assert torch_dist_problem(ckpt) is None and TorchDistReader(ckpt).common_state() is not None
    s = saved[0]
    # Both TP ranks agree on the gathered model.
    for name in s["params"]:
        assert torch.equal(s["params"][name], saved[1]["params"][name]), name

    tp1 = run_local(rh.load_checkpoint_worker, 1, ParallelLayout(), dense_ref["ckpt"], ckpt, True, timeout=TIMEOUT)[0]
    dp2 = run_local(rh.load_checkpoint_worker, 2, ParallelLayout(), dense_ref["ckpt"], ckpt, False, timeout=TIMEOUT)
    saved_after = [x for step in s["after"] for x in step["losses"]]

    for what, restored, after_losses in (
        ("TP=1", tp1["full"], [x for step in tp1["full"]["after"] for x in step["losses"]]),
        ("DP=2", dp2[0]["full"], [x for i in range(2) for x in _dp_losses(dp2, key=lambda r, i=i: r["full"]["after"][i]["losses"])]),
    ):
        assert set(restored["params"]) == set(s["params"])
        moved = max(float((restored["before"][k] - s["params"][k]).abs().max()) for k in s["params"])
        assert moved > 1e-4, f"{what}: the model started equal to the checkpoint; the test proves nothing"
        for name, value in s["params"].items():
            assert torch.equal(restored["params"][name], value), f"{what}: {name} not restored exactly"
        _close(restored["logits"], s["logits"], atol=1e-5, what=f"{what}: logits")
        # The steps after the restore need Adam's moments and step count from the checkpoint.
        _close(after_losses, saved_after, atol=1e-5, what=f"{what}: losses after resuming")
        _close([x["grad_norm"] for x in restored["after"]], [x["grad_norm"] for x in s["after"]], atol=0, rtol=1e-5,
               what=f"{what}: grad norms after resuming")

    # Control: the same model restored without its optimizer state diverges on the second step.
    control = tp1["model_only"]["after"][1]["losses"]
    assert max(abs(a - b) for a, b in zip(control, s["after"][1]["losses"])) > 1e-3


# --- 5. the layer stays out of the way ---------------------------------------------------------------

_PROBE = r"""
import json, sys, torch
mode = sys.argv[1]
if mode == "cuda":
    torch.cuda.is_available = lambda: True
if mode == "old-mcore":
    from megatron.core import package_info
    package_info.__version__ = "0.17.0"
from megatron_patch.runtime import cpu_compat, distributed
from megatron.core.optimizer import distrib_optimizer
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

def snapshot():
    return dict(
        zeros=torch.zeros, empty=torch.empty, tensor_cuda=torch.Tensor.cuda, tensor_to=torch.Tensor.to,
        tensor_type=torch.Tensor.type, current_device=torch.cuda.current_device, stream=torch.cuda.Stream,
        cuda_rng=torch.cuda.get_rng_state, gather=mappings._gather_along_first_dim,
        move=moe_utils.maybe_move_tensor_to_cpu, norm=WrappedTorchNorm.__dict__["__new__"],
        optim_load=distrib_optimizer.DistributedOptimizer.load_state_dict,
        yarn_init=YarnRotaryEmbedding.__init__,
    )

before = snapshot()
error = None
try:
    result = cpu_compat.enable()
except Exception as exc:
    result, error = None, f"{type(exc).__name__}: {exc}"
after = snapshot()
from megatron.core import package_info
from megatron.core.transformer import multi_latent_attention
print(json.dumps(dict(
    # what megatron-core leaves undone without transformer-engine, on CPU and GPU alike
    te_gemm_defined=hasattr(moe_utils, "te_general_gemm"), mla_have_te=bool(multi_latent_attention.HAVE_TE),
    result=result, enabled=cpu_compat.is_enabled(), error=error, backend=distributed.backend(),
    applied=list(cpu_compat.applied()),
    expected=[p.name for p in cpu_compat.patches_for(package_info.__version__)],
    untouched=sorted(k for k in before if after[k] is before[k]), total=len(before),
    zeros_device=str(torch.zeros(1, device="cuda").device) if result else None,
)))
"""


def _probe(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MP_CPU_COMPAT_ANY_MCORE"}
    proc = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_layer_patches_when_cuda_absent():
    """The control for the next test: on this machine every watched spot is replaced."""
    r = _probe("cpu")
    assert r["result"] is True and r["enabled"] is True and r["error"] is None
    assert r["untouched"] == [], r["untouched"]
    assert r["zeros_device"] == "cpu" and r["backend"] == "gloo"
    # This release's row of the version rule, and nothing else, was applied.
    assert r["applied"] == r["expected"] and r["applied"], r


def test_each_patch_applies_to_the_releases_that_need_it():
    from megatron_patch.runtime import cpu_compat

    names = {v: [p.name for p in cpu_compat.patches_for(v)] for v in ("0.16.1", "0.19.0rc1", "0.19.2")}
    assert "MLA without TE" in names["0.16.1"] and "MLA without TE" not in names["0.19.2"]
    assert "MoE te_general_gemm" in names["0.16.1"] and "MoE te_general_gemm" not in names["0.19.2"]
    assert names["0.19.0rc1"] == names["0.19.2"]
    assert {p.name for p in cpu_compat.PATCHES} == set(names["0.16.1"]) | set(names["0.19.2"])
    # Every row names only audited releases; an unaudited one tried anyway gets its nearest older audited row.
    assert all(set(p.releases) <= set(cpu_compat.SUPPORTED_MCORE) for p in cpu_compat.PATCHES)
    assert cpu_compat.patches_for("0.20.0") == cpu_compat.patches_for("0.19.2")
    assert cpu_compat.patches_for("0.17.0") == cpu_compat.patches_for("0.16.1")


def test_layer_does_nothing_when_cuda_present():
    """On a GPU without transformer-engine only its gaps are filled (megatron-core 0.16 left the MoE router's
    ``te_general_gemm`` undefined and MLA believing TE was there: a crash in every MoE or MLA forward), and the
    distributed optimizer's checkpointing with torch's Adam, which megatron-core falls back to there as on CPU (a
    resume gave every parameter one step tensor, which torch's Adam bumped once per parameter: bias correction ran
    ahead)."""
    r = _probe("cuda")
    assert r["result"] is False and r["enabled"] is False and r["error"] is None
    assert "optim_load" not in r["untouched"] and len(r["untouched"]) == r["total"] - 1, r["untouched"]
    assert r["backend"] == "nccl"
    assert (r["te_gemm_defined"], r["mla_have_te"]) == (True, False)


def test_unsupported_mcore_version_is_refused(monkeypatch):
    from megatron.core import package_info

    from megatron_patch.runtime import cpu_compat

    monkeypatch.delenv("MP_CPU_COMPAT_ANY_MCORE", raising=False)
    for supported in ("0.16.1", "0.19.2"):
        monkeypatch.setattr(package_info, "__version__", supported)
        assert cpu_compat.check_mcore_version() == supported
    for unknown in ("0.17.0", "0.18.1", "0.20.0", "0.15.3"):
        monkeypatch.setattr(package_info, "__version__", unknown)
        with pytest.raises(UserError, match=rf"megatron-core 0\.16\.x and 0\.19\.x, found {re.escape(unknown)}") as info:
            cpu_compat.check_mcore_version()
        message = str(info.value)
        assert "\n" not in message and "MP_CPU_COMPAT_ANY_MCORE=1" in message, message
    monkeypatch.setenv("MP_CPU_COMPAT_ANY_MCORE", "1")
    assert cpu_compat.check_mcore_version() == "0.15.3"

    # enable() refuses before it patches anything.
    r = _probe("old-mcore")
    assert r["result"] is None and r["enabled"] is False
    assert r["error"].startswith("UserError:") and "0.17.0" in r["error"]
    assert len(r["untouched"]) == r["total"], r["untouched"]


@pytest.mark.slow
def test_device_contexts_still_work_after_the_layer(tmp_path):
    """Regression: wrapping torch.tensor & co. must not break `with torch.device("meta")`.

    transformers builds models under such a context; when torch's constructor cache was filled
    with our wrappers, an HF model loaded after `enable()` got uninitialised buffers and its logits
    changed from one load to the next.
    """
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    hf = make_tiny_hf_checkpoint("qwen2", tmp_path / "qwen2", seed=0)
    code = f"""
import torch
from megatron_patch.runtime import cpu_compat
assert cpu_compat.enable()
with torch.device("meta"):
    assert torch.tensor([1.0]).is_meta and torch.arange(3).is_meta and torch.zeros(2).is_meta
from transformers import AutoModelForCausalLM
tokens = torch.arange(24).reshape(2, 12)
logits = []
for _ in range(3):
    model = AutoModelForCausalLM.from_pretrained({str(hf)!r}).eval()
    with torch.no_grad():
        logits.append(model(tokens).logits)
assert all(torch.equal(logits[0], other) for other in logits[1:]), [float((o - logits[0]).abs().max()) for o in logits]
assert torch.isfinite(logits[0]).all()
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


# --- run_local: how a rank's failure reaches the caller --------------------------------------------

@pytest.mark.slow
def test_run_local_works_from_a_script_on_stdin():
    """``python -`` (the GPU suite's inline steps) has no main file for spawned ranks to re-run; they used to
    die at start ("No such file or directory: '<stdin>'"), and with them the skeleton helper."""
    code = "import os\nfrom megatron_patch.runtime.launch import run_local\nprint('pid', run_local(os.getpid, 1)[0] > 0)\n"
    proc = subprocess.run([sys.executable, "-"], input=code, text=True, capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO}, cwd=REPO)
    assert proc.returncode == 0 and "pid True" in proc.stdout, proc.stderr[-3000:]


def test_run_local_spawns_its_ranks_where_a_cuda_device_is(monkeypatch):
    """On the lent H100 every rank forked from the fork server failed at torch.cuda.set_device ("Cannot
    re-initialize CUDA in forked subprocess"): where a CUDA device is, the ranks are spawned, and still run."""
    import multiprocessing as mp

    from megatron_patch.runtime import launch

    monkeypatch.delenv("MP_LOCAL_START", raising=False)
    monkeypatch.setattr(launch, "_cuda_present", lambda: False)
    if "forkserver" in mp.get_all_start_methods():
        assert launch._start_context().get_start_method() == "forkserver"
    monkeypatch.setattr(launch, "_cuda_present", lambda: True)
    assert launch._start_context().get_start_method() == "spawn"
    pids = launch.run_local(os.getpid, 2, timeout=120)
    assert len(set(pids)) == 2 and os.getpid() not in pids


def test_ranks_still_fork_under_a_tmpdir_too_deep_for_a_unix_socket(tmp_path):
    """The fork server listens on TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX; with a TMPDIR deeper than 75 bytes (a job's
    scratch folder; CI's pytest-102 folder) every evaluation and local training start failed with "internal error:
    OSError: AF_UNIX path too long". multiprocessing's folder moves to the system's temporary folder there, the
    ranks still fork from the server, and the deep TMPDIR gets no multiprocessing folder."""
    deep = tmp_path / ("d" * (120 - len(str(tmp_path))))
    deep.mkdir()
    code = ("import os, tempfile\nfrom megatron_patch.runtime import launch\n"
            "print('start', launch._start_context().get_start_method())\n"
            "print('ranks', len(set(launch.run_local(os.getpid, 2, timeout=120))))\n")
    proc = subprocess.run([sys.executable, "-"], input=code, text=True, capture_output=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(deep), "MP_LOCAL_START": ""})
    assert proc.returncode == 0 and proc.stdout.split() == ["start", "forkserver", "ranks", "2"], proc.stderr[-3000:]
    assert not [p.name for p in deep.iterdir() if p.name.startswith(("pymp-", scratch.PREFIX))]


def test_ctrl_c_with_a_rank_that_must_be_killed_says_nothing_more(tmp_path):
    """Ctrl-C during `mpatch eval --tp 2`: "interrupted", then multiprocessing's resource tracker warned of a leaked
    semaphore, tqdm's write lock in a rank that was still blocked 5 s later and killed. A rank's bars take a thread
    lock now, which leaves nothing to clean up."""
    code = ("import sys\nfrom megatron_patch.runtime.launch import run_local\n"
            "from tests.runtime_helpers import stuck_after_a_bar\n"
            f"try:\n    run_local(stuck_after_a_bar, 2, {str(tmp_path)!r}, timeout=120)\n"
            "except KeyboardInterrupt:\n    sys.exit(130)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": REPO}, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.iterdir())) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "leaked" not in err and "Traceback" not in err, err


def test_run_local_reraises_a_ranks_user_error_as_itself():
    from megatron_patch.runtime.launch import run_local
    from tests.runtime_helpers import raise_user_error_on_rank_1

    with pytest.raises(UserError, match="^TP=3 does not divide the heads$"):
        run_local(raise_user_error_on_rank_1, 2, "TP=3 does not divide the heads", timeout=120)


@pytest.mark.slow
def test_run_local_reports_other_failures_with_the_traceback_and_dead_ranks_at_once():
    from megatron_patch.runtime.launch import WorkerError, run_local
    from tests.runtime_helpers import die_without_reporting, raise_value_error

    with pytest.raises(WorkerError, match=r"^rank 0 failed: ValueError: not a user error \(at runtime_helpers.py:\d+ "
                                          r"on the rank\)$") as info:
        run_local(raise_value_error, 1, timeout=120)
    # the rank's traceback is kept (MPATCH_DEBUG=1 prints it), not quoted in the one line (the eval audit)
    assert "Traceback" in info.value.worker_traceback and "raise_value_error" in info.value.worker_traceback
    # Found dead and named, instead of "timed out after 300s".
    with pytest.raises(WorkerError, match="exited with code 3 before reporting"):
        run_local(die_without_reporting, 2, 3, timeout=300)


@pytest.mark.slow
def test_run_local_starts_again_when_its_port_was_taken(monkeypatch):
    """free_port() can hand out a port another process binds before rank 0 does (tests running side by
    side did): the job starts again on another port instead of failing."""
    import socket

    from megatron_patch.runtime import launch
    from megatron_patch.runtime.distributed import free_port
    from tests.runtime_helpers import join_and_report_world

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    monkeypatch.setattr(launch, "free_port", lambda: next(ports, None) or free_port())
    try:
        assert launch.run_local(join_and_report_world, 2, timeout=300) == [2, 2]
    finally:
        taken.close()


@pytest.mark.slow
def test_a_lost_port_is_started_again_whichever_rank_reports_first(tmp_path):
    """Under load, rank 1's lost connection reached run_local before rank 0's EADDRINUSE, and the job failed
    instead of starting again on another port (the stop 71 CI rehearsal): every rank's report is read."""
    from megatron_patch.runtime import launch
    from tests.runtime_helpers import lose_the_port_on_the_first_attempt

    attempts = tmp_path / "attempts"
    assert launch.run_local(lose_the_port_on_the_first_attempt, 2, str(attempts), timeout=120) == [0, 1]
    assert attempts.read_text() == "xx"


_RNG_PROBE = r"""
import io, json, logging, torch
from megatron_patch.runtime import cpu_compat
cpu_compat.enable()
from megatron.core.tensor_parallel import random as mp_random
log = io.StringIO()
logging.getLogger().addHandler(logging.StreamHandler(log))
tracker = mp_random.get_cuda_rng_tracker()
tracker.add("model-parallel-rng", 1234)
before = torch.get_rng_state()
with tracker.fork():
    kept = torch.nn.functional.dropout(torch.ones(64), 0.5)
print(json.dumps(dict(log=log.getvalue(), restored=bool(torch.equal(before, torch.get_rng_state())),
                      dropped=int((kept == 0).sum()))))
"""


def test_the_model_parallel_rng_fork_is_quiet_on_cpu():
    """On CPU the tracker's "CUDA generator" is the CPU one, so its fork() warned at every random op inside it
    (LoRA's dropout: 96 lines in 3 iterations) that the CPU generator moved; it still puts the state back."""
    proc = subprocess.run([sys.executable, "-c", _RNG_PROBE], capture_output=True, text=True, cwd=REPO,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["log"] == "" and r["restored"] and 0 < r["dropped"] < 64, r


def test_a_killed_process_scratch_folder_is_swept_and_a_live_ones_is_kept(tmp_path):
    """scratch.sweep_abandoned removes the folders whose owner is gone however it ended (a SIGKILL here), by the
    owner file's lock, and keeps a live process's, one still being made (its owner file empty), and what is not a
    folder of this kind (a link by its name, a plain file)."""
    hold = ("import os, sys, signal, time\nfrom megatron_patch.runtime import scratch\n"
            "print(scratch.make_owned_folder(sys.argv[1], sys.argv[2]), flush=True)\n"
            "if sys.argv[1] == 'killed':\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(600)\n")
    env = {**os.environ, "PYTHONPATH": REPO}
    killed = subprocess.run([sys.executable, "-c", hold, "killed", str(tmp_path)], env=env, capture_output=True,
                            text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    live = subprocess.Popen([sys.executable, "-c", hold, "live", str(tmp_path)], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        live_folder = live.stdout.readline().strip()
        being_made = tmp_path / f"{scratch.PREFIX}new-x"
        being_made.mkdir()
        (being_made / scratch.OWNER).touch()
        (tmp_path / f"{scratch.PREFIX}link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / f"{scratch.PREFIX}file").write_text("")
        assert scratch.sweep_abandoned(str(tmp_path)) == [killed.stdout.strip()]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [Path(live_folder).name, being_made.name, f"{scratch.PREFIX}link", "elsewhere", f"{scratch.PREFIX}file"])
    finally:
        live.kill()
        live.wait()
    assert scratch.sweep_abandoned(str(tmp_path)) == [live_folder]
