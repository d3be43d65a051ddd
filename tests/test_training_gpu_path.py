"""The GPU path of training (issue 14), checked on CPU wherever the logic allows.

Each defect a read against Megatron-LM found has a test here that runs on CPU: the batch reaches the
model's device, CP ranks get Megatron's sequence layout, packed SFT computes what unpacked SFT
computes, pipeline stages get their own seeds, the schedule gets the overlap hooks, TE's userbuffers
get the right shape and API, the warm-up iteration is left out of throughput, Apex-less machines
get no gradient-accumulation fusion. What only a GPU can show is in the ``gpu``-marked tests at the
end, skipped here with the reason.
"""

from __future__ import annotations

import enum
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_patch.runtime.distributed import ParallelLayout
from megatron_patch.training.loop import (StepContext, _forward_step, configure_overlap, prepare_batch,
                                          split_for_context_parallel)
from tests.training_helpers import launcher_args, make_corpus, make_texts, make_tokenizer, write_jsonl

REPO = Path(__file__).resolve().parents[1]
META = torch.device("meta")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run scripts/gpu_suite.sh there)")


def _batch(b=2, s=8, packed=False) -> dict:
    out = {"tokens": torch.arange(b * s).reshape(b, s), "labels": torch.arange(b * s).reshape(b, s) + 1,
           "loss_mask": torch.ones(b, s), "position_ids": torch.arange(s).repeat(b, 1)}
    if packed:
        starts = torch.zeros(b, s, dtype=torch.bool)
        starts[:, 0] = True
        starts[0, 3] = starts[1, 5] = True
        out["doc_start"] = starts
    return out


# --- 1. batches go to the model's device ------------------------------------------------------------------

def test_every_batch_tensor_reaches_the_model_device():
    for packed in (False, True):
        batch, params = prepare_batch(_batch(packed=packed), StepContext(vocab_size=100, device=META))
        assert {k: v.device.type for k, v in batch.items()} == {k: "meta" for k in batch}, packed
        assert (params is not None) == packed
        if packed:
            assert params.cu_seqlens_q.device.type == "meta" and params.qkv_format == "thd"


class _Recorder(torch.nn.Module):
    """Stands in for GPTModel: records what the forward step hands it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, tokens, position_ids, attention_mask, packed_seq_params=None):
        self.calls.append(dict(tokens=tokens, attention_mask=attention_mask, packed=packed_seq_params))
        return torch.zeros(*tokens.shape, 4)


def test_forward_step_gives_packed_samples_to_the_model_as_thd():
    """What transformer-engine needs to keep documents apart: boundaries, not a mask it would ignore."""
    model = _Recorder()
    _forward_step(StepContext(vocab_size=100, device=torch.device("cpu")), iter([_batch(packed=True)]), model)
    call = model.calls[0]
    assert call["attention_mask"] is None and call["tokens"].shape == (1, 16)
    assert call["packed"].cu_seqlens_q.tolist() == [0, 3, 8, 13, 16]
    assert call["packed"].max_seqlen_q == 5 and call["packed"].cu_seqlens_q.dtype == torch.int32
    _forward_step(StepContext(vocab_size=100, device=torch.device("cpu")), iter([_batch()]), model)
    assert model.calls[1]["packed"] is None and model.calls[1]["tokens"].shape == (2, 8)


def test_packed_samples_mark_documents_and_padding():
    from megatron_patch.training.sft_data import _sample

    s = _sample(list(range(1, 12)), [1] * 11, 16, pad=0, doc_starts=[0, 4, 7])
    # documents at 0, 4, 7; 10 real tokens; the padding from 10 is a segment of its own
    assert s["doc_start"].nonzero().flatten().tolist() == [0, 4, 7, 10]
    assert s["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 4, 5]
    assert "attention_mask" not in s


# --- 9. context parallelism splits the sequence -----------------------------------------------------------

def test_context_parallel_ranks_get_megatrons_balanced_chunks():
    batch = _batch(b=2, s=16)
    parts = [split_for_context_parallel(dict(batch), 2, r) for r in range(2)]
    chunk = 16 // 4
    for r, part in enumerate(parts):
        assert part["tokens"].shape == (2, 8)
        for key in batch:
            # rank r: chunks r and 2*CP-1-r, as megatron-core's CP attention and RoPE slicing expect
            want = torch.cat([batch[key][:, r * chunk:(r + 1) * chunk], batch[key][:, (3 - r) * chunk:(4 - r) * chunk]], 1)
            assert torch.equal(part[key], want), (r, key)
    joined = torch.cat([parts[0]["tokens"][:, :4], parts[1]["tokens"], parts[0]["tokens"][:, 4:]], dim=1)
    assert torch.equal(joined, batch["tokens"])
    assert split_for_context_parallel(batch, 1, 0) is batch


def test_forward_step_splits_for_this_cp_rank():
    model = _Recorder()
    ctx = StepContext(vocab_size=100, device=torch.device("cpu"), cp_size=2, cp_rank=1)
    _forward_step(ctx, iter([_batch(b=1, s=16)]), model)
    assert model.calls[0]["tokens"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.mark.parametrize("weighting", ["token", "record"])
def test_context_parallel_ranks_gradients_add_up_to_the_whole_sequences(monkeypatch, weighting):
    """CP=2: megatron-core's schedule multiplies each rank's (loss, report) by the CP size and DDP averages the
    gradients over DP x CP; the loss function returned the rank's share already multiplied by the CP size, so a
    CP=2 run trained with twice the gradient of CP=1 (its clipping and logged norm too). Each rank here computes its
    share as the schedule and DDP then treat it; their gradients must add up to CP=1's. With SFT's per-record loss
    (MP_SFT_LOSS=record) too: each token's weight travels with its token."""
    import inspect

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    from megatron_patch.training import loop
    from megatron_patch.training.loop import _loss_func

    # the token losses without a tensor-parallel group (megatron-core's vocab-parallel cross-entropy needs one)
    monkeypatch.setattr(loop, "_token_losses", lambda vocab, labels, logits: torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), labels, reduction="none"))
    # the schedule's factor this test stands in for (a megatron-core that drops it changes the arithmetic)
    assert "output_tensor *= cp_group_size" in inspect.getsource(schedules)
    vocab, cp = 11, 2
    gen = torch.Generator().manual_seed(0)
    batch = {"labels": torch.randint(0, vocab, (2, 8), generator=gen),
             "loss_mask": (torch.rand(2, 8, generator=gen) > 0.3).float()}
    batch["loss_mask"][1, :4] = 0  # the second record trains fewer tokens
    logits = torch.randn(8, 2, vocab, generator=gen, requires_grad=True)  # [s, b, v], as the model returns them
    if weighting == "record":
        from megatron_patch.training.record_loss import LOSS_WEIGHT, weigh_records

        (batch,) = weigh_records([batch])
        assert len(set(batch[LOSS_WEIGHT][batch["loss_mask"] > 0].tolist())) == 2  # two records, unequal lengths

    whole, _ = _loss_func(batch["loss_mask"], batch["labels"], vocab, 1, False, batch.get("loss_weight"), logits)
    (want,) = torch.autograd.grad(whole, logits)

    rows = split_for_context_parallel({"pos": torch.arange(8).repeat(2, 1)}, cp, 0)["pos"][0], \
        split_for_context_parallel({"pos": torch.arange(8).repeat(2, 1)}, cp, 1)["pos"][0]
    parts = [{k: v[:, r] for k, v in batch.items()} for r in rows]
    monkeypatch.setattr(parallel_state, "get_context_parallel_group", lambda: None)
    got = torch.zeros_like(logits)
    for rank, r in enumerate(rows):
        # the CP all-reduce of the (loss sum, token count) pair: the other ranks' count added (their sum is reported)
        count = sum(p["loss_mask"].sum() for p in parts if p is not parts[rank])
        others = torch.stack([torch.tensor(0.0), count, count])
        monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, group=None, o=others: t.add_(o))
        share, _ = _loss_func(parts[rank]["loss_mask"], parts[rank]["labels"], vocab, cp, False,
                              parts[rank].get("loss_weight"), logits[r])
        (grad,) = torch.autograd.grad(share * cp / cp, logits)  # the schedule's x CP, DDP's average over CP
        got += grad
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), float((got - want).abs().max() / want.abs().max())


# --- 13. overlap hooks for the pipeline schedules ------------------------------------------------------------

class _FakeDDP:
    def no_sync(self):
        pass

    def start_grad_sync(self, *a):
        pass

    def start_param_sync(self, *a, **k):
        pass


def test_schedule_gets_grad_and_param_sync_functions():
    one, chunks = [_FakeDDP()], [_FakeDDP(), _FakeDDP()]
    overlap = {"overlap_grad_reduce": True, "overlap_param_gather": True}
    cfg = types.SimpleNamespace(no_sync_func=None, grad_sync_func=None, param_sync_func=None)
    configure_overlap(cfg, one, overlap)
    assert cfg.grad_sync_func == one[0].start_grad_sync and cfg.no_sync_func == one[0].no_sync
    assert cfg.param_sync_func is None  # only the interleaved schedule gathers ahead
    cfg = types.SimpleNamespace(no_sync_func=None, grad_sync_func=None, param_sync_func=None)
    configure_overlap(cfg, chunks, overlap)
    assert cfg.grad_sync_func == [c.start_grad_sync for c in chunks]
    assert cfg.param_sync_func == [c.start_param_sync for c in chunks]
    cfg = types.SimpleNamespace(no_sync_func=None, grad_sync_func=None, param_sync_func=None)
    configure_overlap(cfg, chunks, {"overlap_grad_reduce": False, "overlap_param_gather": False})
    assert cfg.grad_sync_func is None and cfg.param_sync_func is None


def test_throughput_leaves_warmup_iterations_out():
    from megatron_patch.training.throughput import describe, summarize

    records = [dict(iteration=1, loss=5.0, iteration_s=10.0, tokens=1000, tflops_per_gpu=1.0, memory_gib=9.0,
                    warmup=True)]
    records += [dict(iteration=i, loss=4.0, iteration_s=1.0 + (i == 3), tokens=1000, tflops_per_gpu=t,
                     memory_gib=5.0, warmup=False) for i, t in ((2, 100.0), (3, 50.0))]
    s = summarize(records, peak_tflops=200.0)
    assert s["iterations"] == [2, 3] and s["warmup_excluded"] == 1 and s["seconds"] == 3.0
    assert s["tokens_per_s"] == 2000 / 3.0
    assert abs(s["tflops_per_gpu"] - (100.0 + 2 * 50.0) / 3.0) < 1e-12  # time-weighted
    assert abs(s["mfu"] - s["tflops_per_gpu"] / 200.0) < 1e-12 and s["peak_memory_gib"] == 5.0
    assert "1 warm-up iteration(s) left out" in describe(s)
    assert "66.7 TFLOP/s per GPU, MFU 33.3% of 200" in describe(s)
    assert summarize(records[:1]) is None
    # A CPU rank's rate, as its iteration lines give it: per process, and not rounded to 0.00 (the num audit)
    cpu = summarize([dict(r, tflops_per_gpu=0.00234) for r in records])
    assert "0.00234 TFLOP/s per process, peak memory" in describe(cpu, per="process")


def test_a_model_whose_flops_are_not_counted_reports_no_tflops():
    """DeepSeek-V4's compressed attention is no layer type the FLOPs formula knows: counted as full attention its
    TFLOP/s and MFU would be wrong, so the loop records none and the summary says so."""
    from types import SimpleNamespace

    from megatron_patch.models.description.registry import families, parse_arch
    from megatron_patch.training.loop import flops_per_iteration
    from megatron_patch.training.throughput import describe, summarize

    cfg = SimpleNamespace(sample_length=64, global_batch_size=8)
    assert flops_per_iteration(parse_arch(families()["deepseek_v4"].tiny_config), cfg) is None
    assert flops_per_iteration(parse_arch(families()["deepseek_v3"].tiny_config), cfg) > 0
    records = [dict(iteration=i, loss=4.0, iteration_s=1.0, tokens=1000, tflops_per_gpu=None, memory_gib=5.0,
                    warmup=i == 1) for i in (1, 2, 3)]
    s = summarize(records, peak_tflops=989.0)
    assert s["tflops_per_gpu"] is None and s["mfu"] is None and s["tokens_per_s"] == 1000.0
    assert "TFLOP/s not counted" in describe(s)


def test_mfu_is_measured_against_the_gpus_dense_peak():
    from megatron_patch.training.throughput import peak_tflops

    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("NVIDIA H200") == 989.0  # fp8 runs too: their MFU reads directly against bf16's
    assert peak_tflops("NVIDIA GeForce RTX 3090") is None  # unknown: no MFU rather than a wrong one


# --- 2. transformer-engine userbuffers for TP communication overlap -------------------------------------------

class _Modes(enum.Enum):
    NONE = 0
    FP8 = 1


def _te_base(new_api: bool):
    calls = []
    if new_api:
        def initialize_ub(shape, tp_size, quantization_modes=None, ub_cfgs=None, bootstrap_backend=None):
            calls.append(dict(shape=shape, tp_size=tp_size, quantization_modes=quantization_modes,
                              bootstrap_backend=bootstrap_backend))
    else:
        def initialize_ub(shape, tp_size, use_fp8=False, ub_cfgs=None):
            calls.append(dict(shape=shape, tp_size=tp_size, use_fp8=use_fp8))
    return types.SimpleNamespace(initialize_ub=initialize_ub, UserBufferQuantizationMode=_Modes), calls


def test_userbuffers_get_the_micro_batch_shape_and_the_api_te_has(tmp_path):
    from megatron_patch.training.gpu_setup import initialize_tp_communicators
    from megatron_patch.training.validation import resolve

    data = tmp_path / "d_text_document"
    for suffix in (".bin", ".idx"):
        Path(str(data) + suffix).write_bytes(b"")
    args = launcher_args("llama3_1", ENV="dsw", PR="fp8", TP="2", CP="2", SP="true", BATCH_SIZE="2",
                         GLOBAL_BATCH_SIZE="8", SEQ_LEN="128", DATASET_PATH=str(data), OUTPUT_BASEPATH=str(tmp_path))
    cfg = resolve("llama3_1", args, env={"GPUS_PER_NODE": "4"})
    te, calls = _te_base(new_api=True)
    env = {}
    initialize_tp_communicators(cfg, 64, te_base=te, multicast=False, env=env)
    # [SEQ_LEN * BATCH_SIZE / CP, hidden], FP8 buffers for PR=fp8
    assert calls == [dict(shape=[128, 64], tp_size=2, quantization_modes=[_Modes.FP8], bootstrap_backend="nccl")]
    assert env == {"UB_SKIPMC": "1"}  # no NVLink multicast: userbuffers must not try it

    bf16 = resolve("llama3_1", [a if a != "fp8" else "bf16" for a in args], env={"GPUS_PER_NODE": "4"})
    old_te, old_calls = _te_base(new_api=False)
    env = {"UB_SKIPMC": "0"}
    initialize_tp_communicators(bf16, 64, te_base=old_te, multicast=True, env=env)
    assert old_calls == [dict(shape=[128, 64], tp_size=2, use_fp8=False)] and env == {"UB_SKIPMC": "0"}
    te, calls = _te_base(new_api=True)
    initialize_tp_communicators(bf16, 64, te_base=te, multicast=True, env={})
    assert calls[0]["quantization_modes"] == [_Modes.NONE]


# --- 8. gradient-accumulation fusion needs Apex's kernel ------------------------------------------------------

def test_gradient_accumulation_fusion_only_with_apex_kernel(monkeypatch):
    """megatron-core's own output layer needs fused_weight_gradient_mlp_cuda; TE alone is not enough."""
    from megatron_patch.models.blocks import builder
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.models.llama3_1.config import TINY_CONFIG

    import importlib.util

    kernel_here = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    assert builder.apex_wgrad_fusion_available() is kernel_here
    arch = parse_arch(TINY_CONFIG)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(builder, "te_available", lambda: True)
    for apex, fused in ((False, False), (True, True)):
        monkeypatch.setattr(builder, "apex_wgrad_fusion_available", lambda: apex)
        # RoPE fusion would insist on transformer-engine being installed here.
        config = builder.transformer_config(arch, ParallelLayout(), torch.bfloat16, apply_rope_fusion=False)
        assert config.gradient_accumulation_fusion is fused


# --- 10, 4, 11: in megatron-core processes (gloo) -------------------------------------------------------------

SFT_RECORDS = [
    {"prompt": "Where does the cat sit?", "response": "The cat sits on the warm mat by the door."},
    {"prompt": "Name a fruit.", "response": "A green apple."},
    {"instruction": "Describe the river.", "output": "A quiet river runs by the old town to the sea."},
    {"prompt": "And a colour?", "response": "Blue, like the house."},
]


def _loss_totals(model, dataset, mbs: int, ctx) -> tuple[float, float]:
    total, count = 0.0, 0.0
    with torch.no_grad():
        for start in range(0, len(dataset), mbs):
            items = [dataset[i] for i in range(start, min(start + mbs, len(dataset)))]
            batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
            output, loss_func = _forward_step(ctx, iter([batch]), model)
            _, stats = loss_func(output)
            total += float(stats["lm loss"][0])
            count += float(stats["lm loss"][1])
    return total, count


def packing_worker(tok_dir: str, sft_path: str) -> dict:
    """Loss sums of the same records unpacked, packed (1 and 2 samples per micro-batch), and packed without
    document boundaries; and the MoE model moved to another device."""
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.models.llama3_1.config import TINY_CONFIG
    from megatron_patch.models.qwen2_moe.config import TINY_CONFIG as MOE_CONFIG
    from megatron_patch.runtime import init_model_parallel
    from megatron_patch.runtime.distributed import move_to_device
    from megatron_patch.tokenizer import load_tokenizer
    from megatron_patch.training.packing import use_packed_local_attention
    from megatron_patch.training.sft_data import SFTDataset

    layout = ParallelLayout()
    init_model_parallel(layout, seed=5)
    arch = parse_arch(TINY_CONFIG)
    model = build_model(arch, layout, torch.float32).eval()
    assert use_packed_local_attention(model) == arch.num_layers
    tok = load_tokenizer(tok_dir)
    plain = SFTDataset(sft_path, tok, 64)
    packed = SFTDataset(sft_path, tok, 64, packing=True)
    ctx = StepContext(vocab_size=arch.vocab_size, device=torch.device("cpu"))
    out = {"plain": _loss_totals(model, plain, 2, ctx), "packed": _loss_totals(model, packed, 1, ctx),
           "packed_mbs2": _loss_totals(model, packed, 2, ctx), "packed_samples": len(packed),
           "docs_per_sample": [int(s["doc_start"].sum()) for s in packed.samples]}
    unmarked = [{k: v for k, v in s.items() if k != "doc_start"} for s in packed.samples]
    out["no_boundaries"] = _loss_totals(model, unmarked, 1, ctx)
    out.update(_pretraining_documents_apart(model, arch.vocab_size, ctx))

    moe = build_model(parse_arch(MOE_CONFIG), layout, torch.float32)
    move_to_device([moe], META)
    router = [p for n, p in moe.named_parameters() if n.endswith("router.weight")]
    gates = [p for n, p in moe.named_parameters() if n.endswith("shared_experts.gate_weight")]
    out["moe_moved"] = bool(router and gates) and all(p.device == META for p in router + gates)
    return out


def _pretraining_documents_apart(model, vocab_size: int, ctx) -> dict:
    """Pretraining samples with MP_SFT_PACKING=true (their documents cut after each end-of-document id), against
    each document run as a sample of its own, and against the samples as they are (documents attending across)."""
    from megatron_patch.training.packing import DocumentsApart

    eod, length = 2, 64
    gen = torch.Generator().manual_seed(3)
    samples, alone = [], []
    # end-of-document positions: inside, first (a one-token document), last (no document after it), none
    for ends in ([10, 30], [0, 40], [length - 1], []):
        ids = torch.randint(3, vocab_size, (length + 1,), generator=gen)
        ids[ends] = eod
        sample = {"tokens": ids[:-1], "labels": ids[1:], "loss_mask": torch.ones(length),
                  "position_ids": torch.arange(length)}
        samples.append(sample)
        bounds = [0] + [e + 1 for e in ends if e + 1 < length] + [length]
        alone += [{k: (v[a:b] if k != "position_ids" else torch.arange(b - a)) for k, v in sample.items()}
                  for a, b in zip(bounds[:-1], bounds[1:])]
    apart = DocumentsApart(samples, eod)
    return {"docs_apart": _loss_totals(model, apart, 1, ctx), "docs_apart_mbs2": _loss_totals(model, apart, 2, ctx),
            "docs_alone": tuple(map(sum, zip(*(_loss_totals(model, [d], 1, ctx) for d in alone)))),
            "docs_together": _loss_totals(model, samples, 1, ctx), "docs_alone_count": len(alone),
            "docs_apart_starts": [apart[i]["doc_start"].nonzero().flatten().tolist() for i in range(len(apart))],
            "docs_apart_positions": apart[1]["position_ids"][:3].tolist() + apart[1]["position_ids"][40:42].tolist()}


def packed_names_worker(family: str) -> dict:
    """A model's parameter and checkpoint names before and after its attention takes packed sequences."""
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.description.registry import families, parse_arch
    from megatron_patch.runtime import init_model_parallel
    from megatron_patch.training.packing import use_packed_local_attention

    init_model_parallel(ParallelLayout())
    model = build_model(parse_arch(families()[family].tiny_config), ParallelLayout(), torch.float32)
    names = (sorted(model.state_dict()), sorted(model.sharded_state_dict()))
    taken = use_packed_local_attention(model)
    return {"taken": taken, "before": names, "after": (sorted(model.state_dict()), sorted(model.sharded_state_dict()))}


def test_packed_attention_keeps_the_names_of_what_the_attention_holds():
    """gpt-oss's core attention holds its sinks (softmax_offset): wrapped for packing, they became
    core_attention.inner.softmax_offset, so a converted checkpoint was refused ("not written for this model") and
    the run's own checkpoints could not be exported."""
    from megatron_patch.runtime.launch import run_local

    r = run_local(packed_names_worker, 1, "gpt_oss")[0]
    assert r["taken"] > 0 and any("softmax_offset" in n for n in r["before"][0])
    assert r["after"] == r["before"]


@pytest.fixture(scope="module")
def packing_results(tmp_path_factory):
    from megatron_patch.runtime.launch import run_local

    root = tmp_path_factory.mktemp("packing")
    tok = make_tokenizer(root / "tok", make_texts(300, seed=1))
    write_jsonl(root / "sft.jsonl", SFT_RECORDS * 3)
    return run_local(packing_worker, 1, str(tok), str(root / "sft.jsonl"), timeout=300)[0]


@pytest.mark.slow
def test_packed_sft_loss_equals_unpacked_loss(packing_results):
    """Same records, same model: packing changes how many tokens share a row, not what is computed."""
    r = packing_results
    assert r["packed_samples"] < len(SFT_RECORDS) * 3 and max(r["docs_per_sample"]) >= 3
    (plain, n), (packed, n_packed), (packed2, n_packed2) = r["plain"], r["packed"], r["packed_mbs2"]
    assert n == n_packed == n_packed2 > 0
    assert abs(packed - plain) <= 1e-5 * abs(plain), (packed, plain)
    assert abs(packed2 - plain) <= 1e-5 * abs(plain), (packed2, plain)
    # Control: the same packed rows without document boundaries (documents attend to each other) differ.
    assert abs(r["no_boundaries"][0] - plain) > 1e-4 * abs(plain), (r["no_boundaries"], plain)


def test_pretraining_documents_kept_apart_compute_each_document_alone(packing_results):
    """MP_SFT_PACKING=true in pretraining: a sample's loss is the sum of its documents' losses, each run alone."""
    r = packing_results
    assert r["docs_apart_starts"] == [[0, 11, 31], [0, 1, 41], [0], [0]]
    assert r["docs_apart_positions"] == [0, 0, 1, 40 - 1, 0]  # restarting after each end-of-document token
    (apart, n), (apart2, n2), (alone, n_alone), (together, n_together) = (
        r["docs_apart"], r["docs_apart_mbs2"], r["docs_alone"], r["docs_together"])
    assert n == n2 == n_alone == n_together == 4 * 64 and r["docs_alone_count"] == 8
    assert abs(apart - alone) <= 1e-5 * abs(alone), (apart, alone)
    assert abs(apart2 - alone) <= 1e-5 * abs(alone), (apart2, alone)
    assert abs(together - alone) > 1e-4 * abs(alone), (together, alone)  # documents attending across differ


@pytest.mark.slow
def test_model_moves_whole_onto_the_device_moe_router_and_gate_included(packing_results):
    assert packing_results["moe_moved"]


def stage_weights_worker() -> dict:
    from megatron.core import parallel_state

    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.models.llama3_1.config import TINY_CONFIG
    from megatron_patch.runtime import init_model_parallel

    layout = ParallelLayout(pp=4)
    init_model_parallel(layout, seed=1234)
    model = build_model(parse_arch(TINY_CONFIG), layout, torch.float32)
    first_layer = model.decoder.layers[0].self_attention.linear_qkv.weight.detach().clone()
    return {"pp_rank": parallel_state.get_pipeline_model_parallel_rank(), "qkv": first_layer}


@pytest.mark.slow
def test_pipeline_stages_start_from_different_weights():
    """From scratch at PP=4 (one layer per stage): the middle stages hold neither embedding nor output
    layer, so with one seed for all stages their layers would be initialised identically."""
    from megatron_patch.runtime.distributed import stage_seed
    from megatron_patch.runtime.launch import run_local

    ranks = run_local(stage_weights_worker, 4, timeout=300)
    assert [r["pp_rank"] for r in ranks] == [0, 1, 2, 3]
    for a in range(4):
        for b in range(a + 1, 4):
            assert not torch.equal(ranks[a]["qkv"], ranks[b]["qkv"]), (a, b)
    assert [stage_seed(1234, p) for p in range(3)] == [1234, 1334, 1434]


# --- on a GPU ----------------------------------------------------------------------------------------------

def _gpu_launch(tmp_path, family="llama3_1", env=None, **over) -> subprocess.CompletedProcess:
    script = REPO / "examples" / family / f"run_mcore_{family}.sh"
    return subprocess.run(["bash", str(script), *launcher_args(family, **over)],
                          env={**os.environ, "PYTHON": sys.executable, "GPUS_PER_NODE": "1", **(env or {})},
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def gpu_corpus(tmp_path_factory):
    corpus = make_corpus(tmp_path_factory.mktemp("gpu_corpus"), 500, seed=2)
    write_jsonl(corpus["root"] / "sft.jsonl", SFT_RECORDS * 8)
    return {**corpus, "sft": corpus["root"] / "sft.jsonl"}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("family,over", [
    ("llama3_1", dict(PR="bf16")),
    ("llama3_1", dict(PR="fp32")),  # defect 3: fp32 attention on the GPU
    ("qwen2_moe", dict(PR="bf16", DO="false")),  # defect 4: router and gate must reach the GPU
])
def test_gpu_training_runs_and_loss_falls(gpu_corpus, tmp_path, family, over):
    """Defects 1 (batches on the GPU), 3, 4, 8, 13 (warm-up): a tiny model trains on one GPU via the launcher."""
    out = tmp_path / "out"
    proc = _gpu_launch(tmp_path, family, ENV="dsw", DATASET_PATH=gpu_corpus["prefix"], OUTPUT_BASEPATH=str(out),
                       LR="3e-3", TRAIN_TOKENS_OR_ITERS=str(8 * 8 * 64), WARMUP_TOKENS_OR_ITERS=str(8 * 64), **over)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    losses = [json.loads(l)["loss"] for l in (out / "log" / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert json.loads((out / "log" / "throughput.json").read_text())["warmup_excluded"] == 1


@pytest.mark.gpu
@needs_gpu
def test_gpu_packed_sft_with_transformer_engine(gpu_corpus, tmp_path):
    """Defect 10 on a GPU: a packed SFT run trains (THD with cu_seqlens: transformer-engine's attention, or
    without TE the SDPA core attention's variable-length kernel)."""
    out = tmp_path / "out"
    proc = _gpu_launch(tmp_path, ENV="dsw", PR="bf16", SFT="true", DATASET_PATH=str(gpu_corpus["sft"]),
                       OUTPUT_BASEPATH=str(out), PAD_LEN="64", TRAIN_TOKENS_OR_ITERS="6", WARMUP_TOKENS_OR_ITERS="1",
                       LR="3e-3", env={"MP_TOKENIZER": str(gpu_corpus["tok"]), "MP_SFT_PACKING": "true"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP communication overlap and CP need 2 GPUs")
def test_gpu_tp_overlap_and_context_parallel(gpu_corpus, tmp_path):
    """Defects 2 (userbuffers), 9 (CP split), 12 (CUDA_DEVICE_MAX_CONNECTIONS) at TP=2 with SP, then CP=2."""
    for name, over in (("tp", dict(TP="2", SP="true")), ("cp", dict(CP="2"))):
        out = tmp_path / name
        proc = _gpu_launch(tmp_path, ENV="dsw", PR="bf16", DATASET_PATH=gpu_corpus["prefix"], OUTPUT_BASEPATH=str(out),
                           TRAIN_TOKENS_OR_ITERS=str(4 * 8 * 64), WARMUP_TOKENS_OR_ITERS=str(8 * 64),
                           env={"GPUS_PER_NODE": "2"}, **over)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
