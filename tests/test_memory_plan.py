"""The memory plan (training/memory_plan.py) against what runs allocate, and the dry run and refusal.

Each configuration is built by the trainer exactly as `mpatch train` builds it and takes one step with
autograd's saved tensors metered (tests/saved_tensors.py):

- model state (parameters, gradient buffers, optimizer state by tier) equals the plan to the byte;
- saved activations come within 10% of the plan for the dense models, across AC none/sel/full, fp32
  and bf16, megatron's unfused attention and SDPA (FL=true), TP=2 with and without sequence parallelism,
  and PP=2 (1F1B: the first stage holds two micro-batches); MoE activations depend on the routing and are
  only printed;
- the trainer builds the core attention the plan assumes.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_patch.cli import main
from megatron_patch.models.description.registry import families, parse_arch
from megatron_patch.runtime.launch import run_local
from megatron_patch.training.memory_plan import GiB, auto_share, plan_memory, stage_memory
from megatron_patch.training.validation import resolve
from tests.memory_helpers import measure_ranks
from tests.training_helpers import launcher_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (family, launcher arguments, environment, whether the activation estimate is checked): the plan's own variations on
# Llama, then each family's cases, which the family declares (TestLayouts.memory_plan)
ONE_PROCESS = [
    ("llama3_1", dict(PR="bf16"), {}, True),  # megatron's Float16Optimizer (DO=false)
    ("llama3_1", dict(PR="bf16", AC="sel"), {}, True),
    ("llama3_1", dict(PR="bf16", AC="full"), {"MP_AC_LAYERS": "2"}, True),
    ("llama3_1", dict(PR="fp32", DO="true"), {}, True),
    ("llama3_1", dict(PR="bf16", FL="true"), {}, True),  # SDPA: its output and log-sum-exp, no s^2 scores
    ("llama3_1", dict(PR="fp32", FL="true", AC="full"), {"MP_AC_LAYERS": "2"}, True),
    ("llama3_1", dict(PR="bf16", OPTIMIZER_OFFLOAD="0.5"), {}, True),  # chunks on both tiers, staging
] + [(name, over, env, checked) for name, family in families().items()
     for over, env, checked in family.test_layouts.memory_plan]
TWO_PROCESSES = [
    ("llama3_1", dict(PR="bf16", TP="2", SP="true", DO="true"), {"MP_TP_COMM_OVERLAP": "false"}, True),
    ("llama3_1", dict(PR="bf16", TP="2", DO="true"), {}, True),
    ("llama3_1", dict(PR="bf16", PP="2", DO="true"), {}, True),
    ("llama3_1", dict(PR="fp32", PP="2", AC="full"), {}, True),
    ("qwen2", dict(PR="bf16", PP="2", DO="true"), {}, True),  # tied embeddings across stages: own bucket
    ("qwen2_moe", dict(PR="bf16", EP="2", DO="true"), {}, False),  # expert buffers, expert DP
    ("deepseek_v3", dict(PR="bf16", TP="2", ETP="2", SP="true", DO="true"), {"MP_TP_COMM_OVERLAP": "false"},
     False),  # MLA's local-spec TP splits
    ("qwen3_moe", dict(PR="bf16", PP="2", DO="true"), {"MP_PP0_LAYERS": "1"}, False),  # its dense layer alone
    # q/k norms whole on each TP rank (their heads' slices used), experts split over TP
    ("minimax_m2", dict(PR="bf16", TP="2", ETP="2", SP="true", DO="true"), {"MP_TP_COMM_OVERLAP": "false"}, False),
    ("llama3_1", dict(PR="bf16", OPTIMIZER_OFFLOAD="0.3"), {"MP_NPROC": "2"}, True),  # DP=2 bucket shards
]


def _cfg(corpus, out, family, over, env):
    args = launcher_args(family, DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(out), SAVE_INTERVAL="100",
                         **over)
    return resolve(family, args, env=env)


def _check(cfgs, results, checked):
    rows = []
    for cfg, measured, check_activations in zip(cfgs, results, checked):
        for r in measured:
            st = stage_memory(cfg.arch, cfg, r["pp_rank"], "local", r["dp_rank"])
            plan = plan_memory(cfg, "local")
            if plan.offload_policy != "off":
                from megatron_patch.training.memory_plan import _place_chunks

                _place_chunks(st, plan.offload_share, cfg.precision.itemsize)
            planned = {k: getattr(st, k) for k in ("params", "grads", "optimizer_device", "optimizer_host")}
            got = {k: r[k] for k in planned}
            ratio = st.activations / r["activations"]
            rows.append((cfg.family, cfg.layout, cfg.precision, cfg.activation_checkpointing, r["pp_rank"], ratio))
            assert planned == got, (cfg.family, str(cfg.layout), r["pp_rank"], planned, got)
            assert r["leftover"] == 0  # every saved tensor was released by backward: the meter saw it all
            assert r["attention"] == plan.attention, (cfg.family, r["attention"], plan.attention)
            if check_activations:
                assert abs(ratio - 1) < 0.10, (cfg.family, str(cfg.layout), cfg.activation_checkpointing, ratio)
    print("\n".join(f"{f} {l} {p} AC={a} stage {s}: planned/measured activations {x:.4f}" for f, l, p, a, s, x in rows))
    for cfg, measured in zip(cfgs, results):  # the plan printed and checked: each stage's fullest DP rank
        plan = plan_memory(cfg, "local")
        for stage in {r["pp_rank"] for r in measured}:
            held = max(r["params"] + r["grads"] + r["optimizer_device"] for r in measured if r["pp_rank"] == stage)
            st = plan.stage(stage)
            assert st.params + st.grads + st.optimizer_device == held, (cfg.family, str(cfg.layout), stage)


@pytest.mark.slow
def test_plan_equals_what_one_process_allocates(corpus, tmp_path):
    cfgs = [_cfg(corpus, tmp_path / str(i), f, o, e) for i, (f, o, e, _) in enumerate(ONE_PROCESS)]
    results = run_local(measure_ranks, 1, cfgs, timeout=900)[0]
    _check(cfgs, [[r] for r in results], [c for *_, c in ONE_PROCESS])


@pytest.mark.slow
def test_plan_equals_what_two_processes_allocate(corpus, tmp_path):
    cfgs = [_cfg(corpus, tmp_path / str(i), f, o, e) for i, (f, o, e, _) in enumerate(TWO_PROCESSES)]
    assert {c.world_size for c in cfgs} == {2}
    per_rank = run_local(measure_ranks, 2, cfgs, timeout=900)
    _check(cfgs, [[rank[i] for rank in per_rank] for i in range(len(cfgs))], [c for *_, c in TWO_PROCESSES])


def test_the_plan_is_the_data_parallel_rank_that_holds_most(corpus, tmp_path):
    """Each DP rank holds its own shard of the optimizer state, whose chunks fall differently under
    OPTIMIZER_OFFLOAD: the plan was DP rank 0's, and rank 1 held more on the device than it printed and than an
    MP_GPU_MEMORY_GB the plan accepted (the odoc audit). It is now each stage's fullest rank."""
    from megatron_patch.training.memory_plan import _place_chunks

    cfg = _cfg(corpus, tmp_path, "llama3_1", dict(PR="bf16", DO="true", OPTIMIZER_OFFLOAD="0.4"), {"MP_NPROC": "2"})
    ranks = [stage_memory(cfg.arch, cfg, 0, "local", r) for r in range(2)]
    for st in ranks:
        _place_chunks(st, 0.4, cfg.precision.itemsize)
    assert ranks[1].optimizer_device > ranks[0].optimizer_device  # the case the audit measured
    plan = plan_memory(cfg, "local")
    assert plan.stage(0).optimizer_device == ranks[1].optimizer_device and plan.stage(0).device == ranks[1].device
    between = (ranks[0].device + ranks[1].device) / 2 / GiB
    with_room = _cfg(corpus, tmp_path, "llama3_1", dict(PR="bf16", DO="true", OPTIMIZER_OFFLOAD="0.4"),
                     {"MP_NPROC": "2", "MP_GPU_MEMORY_GB": repr(between)})
    assert "on pipeline stage 0" in plan_memory(with_room, "local").problem()


def test_every_family_is_planned():
    """Each family's model state is checked against a real run above (every family declares a case)."""
    assert {f for f, *_ in ONE_PROCESS + TWO_PROCESSES} == set(families())


def _gpu_cfg(tmp_path, env=None, family="llama3_1", **over):
    prefix = tmp_path / "c_text_document"
    for suffix in (".bin", ".idx"):
        prefix.with_name(prefix.name + suffix).write_bytes(b"")
    base = dict(ENV="dsw", MODEL_SIZE="8B", PR="bf16", BATCH_SIZE="1", GLOBAL_BATCH_SIZE="8", SEQ_LEN="4096",
                TRAIN_TOKENS_OR_ITERS="1e9", WARMUP_TOKENS_OR_ITERS="1e8", DATASET_PATH=str(prefix),
                OUTPUT_BASEPATH=str(tmp_path / "out"))
    base.update(over)
    return resolve(family, launcher_args(family, **base), env={"GPUS_PER_NODE": "1", **(env or {})})


def test_llama_8b_model_state_counts_its_parameters(tmp_path):
    """8,030,261,248 parameters (Meta's count): bf16 weights, fp32 gradients, fp32 master + Adam moments."""
    plan = plan_memory(_gpu_cfg(tmp_path, DO="true", AC="sel"), "te")
    st = plan.stages[0]
    n = 8_030_261_248
    assert n <= st.params / 2 < n * (1 + 1e-6)  # bucket padding only
    assert n <= st.grads / 4 < n * (1 + 1e-6)
    assert st.optimizer_elements == n
    assert 12 * n <= st.optimizer_device <= 12 * n + 4 * 291  # (+ torch Adam's step per tensor without TE)
    # about 0.6 GiB per layer for a 4K-token micro-batch with TE (Korthikanti et al.: sbh*34 bytes, no s^2 term)
    assert 32 * 0.5 * GiB < st.activations < 32 * 0.7 * GiB, st.activations / GiB
    # does not fit 80 GiB without offload; with auto it does, and auto starts with part of the state on the host
    assert plan_memory(_gpu_cfg(tmp_path, {"MP_GPU_MEMORY_GB": "80"}, DO="true"), "te").problem()
    auto = plan_memory(_gpu_cfg(tmp_path, {"MP_GPU_MEMORY_GB": "80"}, OPTIMIZER_OFFLOAD="auto"), "te")
    assert auto.problem() is None and 0.3 < auto.offload_share < 1.0, auto.offload_share
    pp2 = plan_memory(_gpu_cfg(tmp_path, {"GPUS_PER_NODE": "2"}, PP="2", DO="true"), "te")
    assert pp2.stages[0].in_flight == 2 and pp2.stages[1].in_flight == 1


@pytest.mark.slow
def test_every_published_size_is_planned(tmp_path):
    """The large presets (what the suite cannot run) get their plan: one GPU's stage holds every parameter
    the model has, counted as megatron-core builds it (models/shape/model_shape.py)."""
    from megatron_patch.models.description.registry import families, parse_arch
    from megatron_patch.models.shape.model_shape import model_shapes

    sizes = [(name, size) for name, f in families().items() for size in f.presets if size != "tiny"]
    counts = [s.params() for s in model_shapes([parse_arch(families()[n].presets[z]) for n, z in sizes])]
    for (name, size), n in zip(sizes, counts):
        st = plan_memory(_gpu_cfg(tmp_path, family=name, MODEL_SIZE=size, DO="true"), "te").stages[0]
        # bf16: 2 bytes each, but 4 for those a family keeps in float32 (DeepSeek-V4's hyper-connections, norms)
        bf16_bytes = st.params - 2 * st.float32_elements
        assert n <= bf16_bytes / 2 < n * (1 + 1e-5), (name, size, n, st.params, st.float32_elements)


def test_auto_share_shrinks_as_the_device_grows(tmp_path):
    shares = [plan_memory(_gpu_cfg(tmp_path, {"MP_GPU_MEMORY_GB": str(g)}, OPTIMIZER_OFFLOAD="auto"), "te").offload_share
              for g in (60, 80, 100, 140, 200)]
    assert shares == sorted(shares, reverse=True) and shares[0] > 0.5 and shares[-1] == 0.0, shares
    st = plan_memory(_gpu_cfg(tmp_path, OPTIMIZER_OFFLOAD="auto"), "te").stages[0]
    assert auto_share(st, None, 0) == 0.0  # capacity unknown: everything starts on the device


def test_dry_run_prints_the_plan_and_a_config_that_cannot_fit_is_refused(corpus, tmp_path, monkeypatch, capsys):
    args = launcher_args("llama3_1", DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(tmp_path / "out"), PR="bf16",
                         PP="2", DO="true", OPTIMIZER_OFFLOAD="0.5")
    monkeypatch.setenv("MP_DRY_RUN", "1")
    assert main(["train", "llama3_1", *args]) == 0
    out = capsys.readouterr().out
    assert "memory plan per rank (local layers" in out
    assert "stage 0 (2 layers): params" in out and "stage 1 (2 layers)" in out
    assert "(2 micro-batch(es) x" in out and "on the host" in out
    assert "OPTIMIZER_OFFLOAD static: 50% of the optimizer state on the host" in out
    monkeypatch.setenv("MP_DRY_RUN", "json")
    assert main(["train", "llama3_1", *args]) == 0
    report = json.loads(capsys.readouterr().out)
    stages = report["memory_plan"]["stages"]
    assert [s["pp_rank"] for s in stages] == [0, 1] and stages[0]["optimizer_host"] > 0
    # 2 MiB of device memory: listed by the dry run, refused before anything starts (one line, exit 2)
    monkeypatch.setenv("MP_GPU_MEMORY_GB", str(2 / 1024))
    assert main(["train", "llama3_1", *args]) == 0
    assert any("the memory plan needs" in p for p in json.loads(capsys.readouterr().out)["machine_problems"])
    monkeypatch.delenv("MP_DRY_RUN")
    assert main(["train", "llama3_1", *args]) == 2
    err = capsys.readouterr().err
    assert "the memory plan needs" in err and "on pipeline stage 0 and the device has 2.00 MiB" in err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,streams,hidden,iterations", [((8, 2), 4, 64, 20), ((16, 1), 2, 32, 3)])
def test_hyper_connections_plan_what_autograd_keeps(dtype, tokens, streams, hidden, iterations):
    """DeepSeek-V4's hyper-connected step and its head, planned (memory_plan.hyper_connection_activations,
    hyper_head_activations) as the bytes autograd saves, exactly; and the tiny V4's plan counts them."""
    from types import SimpleNamespace

    from megatron_patch.models.deepseek_v4.hyper_connections import HyperConnection, HyperHead, hyper_connected
    from megatron_patch.training.memory_plan import (Shape, _shape, hyper_connection_activations,
                                                     hyper_head_activations)
    from tests.saved_tensors import SavedTensorMeter

    s, b = tokens
    config = SimpleNamespace(hidden_size=hidden, layernorm_epsilon=1e-6, init_method_std=0.02, sequence_parallel=False)
    hc_settings = SimpleNamespace(hc_mult=streams, hc_sinkhorn_iters=iterations, hc_eps=1e-6)
    step, head = HyperConnection(config, hc_settings), HyperHead(config, hc_settings)
    x = torch.randn(s, b, streams, hidden, dtype=dtype, requires_grad=True) * 1  # a layer's input: not a leaf
    with SavedTensorMeter(exclude=[*step.parameters()]) as kept_by_step:
        hyper_connected(step, lambda t: t, lambda t: t * 1, x)  # the sublayer's own tensors are the layer's
    with SavedTensorMeter(exclude=[*head.parameters()]) as kept_by_head:
        head(x)
    sh = Shape(s=s, b=b, h=hidden, a=hidden, kvw=hidden, hn=hidden, heads=1, f=hidden, vocab=1, tp=1, sp=False,
               d=dtype.itemsize, streams=(streams, iterations))
    assert hyper_connection_activations(sh) == kept_by_step.peak
    assert hyper_head_activations(sh) == kept_by_head.peak

    arch = parse_arch(families()["deepseek_v4"].tiny_config)
    cfg = SimpleNamespace(sample_length=s, cp=1, micro_batch_size=b, precision=SimpleNamespace(itemsize=dtype.itemsize),
                          lora=None, dsa=None, tp=1, sequence_parallel=False)
    assert _shape(arch, cfg).streams == (4, 20)
