"""DeepSeek-V4's model on megatron-core's GPTModel (models/deepseek_v4/layers.py) and its weight table
(mapping.py): the tiny model (sliding, CSA and HCA attention, hash-routed and top-k MoE layers, 4 streams) with
transformers' random weights (the hash tables drawn as the hub's), saved by save_pretrained, loaded by the table; its logits equal transformers' in fp32.
"""

from __future__ import annotations

import pytest
import torch

from megatron_patch.runtime.distributed import ParallelLayout
from tests.deepseek_v4_helpers import SEQ, assert_same_tensors, hf_dir, round_trip, v4  # noqa: F401

@pytest.fixture(scope="module")
def hf_dir_hash_on_both_stages(tmp_path_factory):
    """The tiny model with a hash-routed layer on each of two pipeline stages (layers 1 and 3)."""
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint("deepseek_v4", tmp_path_factory.mktemp("v4") / "hf", seed=4,
                                   mlp_layer_types=["moe", "hash_moe", "moe", "hash_moe"])


def logits_worker(source: str, layout: ParallelLayout, tokens: torch.Tensor, from_mcore: bool = False):
    """This rank's logits (last stage; None elsewhere) of the model built at ``layout`` with the weights of an HF
    folder, or of a converted MCore checkpoint (``from_mcore``)."""
    from megatron_patch.align.parity import mcore_logits_worker
    from tests.convert_helpers import checkpoint_logits_worker

    if from_mcore:
        return checkpoint_logits_worker(source, layout, tokens)
    return mcore_logits_worker([source], layout, [tokens])[0]


def transformers_and_ours(hf_dir, layout: ParallelLayout, source=None, from_mcore=False):
    from megatron_patch.align.parity import compare_logits, hf_logits, random_tokens
    from megatron_patch.runtime.launch import run_local

    tokens = random_tokens(300, batch=2, seq=SEQ, seed=1)
    results = run_local(logits_worker, layout.world_size, str(source or hf_dir), layout, tokens, from_mcore)
    ours = next(r for r in results if r is not None)
    return compare_logits(hf_logits(hf_dir, tokens), ours)


def test_the_tiny_model_has_transformers_logits(v4, hf_dir):
    from megatron_patch.align.parity import FP32_KL, FP32_REL_L2

    metrics = transformers_and_ours(hf_dir, ParallelLayout())
    assert metrics["rel_l2"] <= FP32_REL_L2 and metrics["kl"] <= FP32_KL, metrics


@pytest.mark.slow
@pytest.mark.parametrize("layout", [ParallelLayout(tp=2), ParallelLayout(ep=2), ParallelLayout(pp=2)], ids=str)
def test_the_tiny_model_has_transformers_logits_across_ranks(v4, hf_dir, hf_dir_hash_on_both_stages, layout):
    """TP=2 (the heads and the output groups split, the rest whole), EP=2 (four experts a rank), PP=2 (the streams
    cross the stage folded into the batch, [s, b * 4, h], and each stage's hash layer routes by the token ids its
    own forward binds)."""
    from megatron_patch.align.parity import FP32_KL, FP32_REL_L2

    metrics = transformers_and_ours(hf_dir_hash_on_both_stages if layout.pp > 1 else hf_dir, layout)
    assert metrics["rel_l2"] <= FP32_REL_L2 and metrics["kl"] <= FP32_KL, metrics


def checkpoint_keys_worker():
    """The torch_dist keys of the tiny model on the local spec (CPU), and the MCore names its weight table plans."""
    import re

    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.description.registry import get_family, parse_arch
    from megatron_patch.models.description.tiny import tiny_config
    from megatron_patch.models.mapping import plan_transfers
    from megatron_patch.runtime import init_model_parallel

    arch = parse_arch(tiny_config("deepseek_v4"))
    init_model_parallel(ParallelLayout())
    model = build_model(arch, ParallelLayout(), use_te=False)
    keys = {entry.key for name, entry in model.sharded_state_dict().items() if not name.endswith("_extra_state")}
    names = {p.mcore_name for t in plan_transfers(get_family("deepseek_v4").weight_rules(arch), arch, ParallelLayout())
             for p in t.placements}
    # each layer under its own keys (moe_layer_freq a list), the experts stacked
    return keys, {re.sub(r"mlp\.experts\.(linear_fc[12])\.weight\d+", r"mlp.experts.experts.\1.weight", n) for n in names}


def test_local_spec_checkpoint_keys_are_the_weight_tables_names(v4):
    """A checkpoint the local spec writes (training on CPU) has the names the converter reads: the query latent's
    norm under its transformer-engine name (``linear_q_up_proj.layer_norm_weight``), not ``q_layernorm.weight``."""
    from megatron_patch.runtime.launch import run_local

    keys, planned = run_local(checkpoint_keys_worker, 1)[0]
    assert keys == planned, (sorted(keys - planned)[:4], sorted(planned - keys)[:4])


def test_the_weight_table_round_trips_bit_exact_at_tp1(v4, hf_dir, tmp_path):
    """Every tensor transformers wrote (the hub's names: attn.wq_a, attn.compressor.wkv, ffn.gate.tid2eid in its
    int64, hc_attn_fn, model.hc_head.hc_fn, head.weight) to megatron-core and back, bit for bit."""
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader

    names = set(HFCheckpointReader(hf_dir).keys())
    assert {"model.layers.0.attn.wq_a.weight", "model.layers.1.attn.compressor.wkv.weight",
            "model.layers.1.attn.indexer.compressor.ape", "model.layers.0.ffn.gate.tid2eid",
            "model.layers.2.ffn.gate.bias", "model.layers.0.hc_attn_fn", "model.hc_head.hc_fn", "head.weight"} <= names
    for fmt in ("legacy", "torch_dist"):
        _, back = round_trip(hf_dir, tmp_path, fmt, ParallelLayout())
        assert_same_tensors(back, hf_dir)


@pytest.mark.slow
@pytest.mark.parametrize("fmt,layout", [("legacy", ParallelLayout(tp=2)), ("torch_dist", ParallelLayout(tp=2)),
                                        ("legacy", ParallelLayout(ep=2)), ("torch_dist", ParallelLayout(ep=2)),
                                        ("torch_dist", ParallelLayout(pp=2)),
                                        ("torch_dist", ParallelLayout(tp=2, ep=2, etp=1))], ids=str)
def test_the_weight_table_round_trips_across_ranks_and_loads_with_transformers_logits(v4, hf_dir, tmp_path, fmt,
                                                                                       layout):
    from megatron_patch.align.parity import FP32_KL, FP32_REL_L2

    ckpt, back = round_trip(hf_dir, tmp_path, fmt, layout)
    assert_same_tensors(back, hf_dir)
    metrics = transformers_and_ours(hf_dir, layout, source=ckpt, from_mcore=True)
    assert metrics["rel_l2"] <= FP32_REL_L2 and metrics["kl"] <= FP32_KL, metrics


def sequence_parallel_logits_worker(source: str, tokens: torch.Tensor):
    """This rank's logits of the model at TP=2 with sequence parallelism, with the weights of an HF folder."""
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.checkpoint.model_io import load_hf_weights
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.blocks.inference import forward_logits
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.runtime import init_model_parallel

    layout = ParallelLayout(tp=2)
    arch = parse_arch(source)
    init_model_parallel(layout)
    model = build_model(arch, layout, sequence_parallel=True)
    assert model.config.sequence_parallel
    load_hf_weights(model, arch, layout, HFCheckpointReader(source))
    return forward_logits(model, tokens, arch.vocab_size)


@pytest.mark.slow
def test_sequence_parallel_gives_transformers_logits(v4, hf_dir):
    """TP=2 with sequence parallelism: the attention gathers the sequence and its output projection scatters it, the
    hyper-connections and the MoE run on each rank's part; TP=1's logits (transformers' in fp32)."""
    from megatron_patch.align.parity import FP32_KL, FP32_REL_L2, compare_logits, hf_logits, random_tokens
    from megatron_patch.runtime.launch import run_local

    tokens = random_tokens(300, batch=2, seq=SEQ, seed=1)
    ours = run_local(sequence_parallel_logits_worker, 2, str(hf_dir), tokens)[0]
    metrics = compare_logits(hf_logits(hf_dir, tokens), ours)
    assert metrics["rel_l2"] <= FP32_REL_L2 and metrics["kl"] <= FP32_KL, metrics


def gradients_worker(source: str, tokens: torch.Tensor, recompute: dict):
    """Every parameter's gradient of the tiny model's summed logits, trained with ``recompute`` (config overrides)."""
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.checkpoint.model_io import load_hf_weights
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.runtime import init_model_parallel

    arch = parse_arch(source)
    init_model_parallel(ParallelLayout())
    model = build_model(arch, ParallelLayout(), **recompute)
    load_hf_weights(model, arch, ParallelLayout(), HFCheckpointReader(source))
    model.train()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    logits = model(tokens, positions, None)
    (logits.float() * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_full_recompute_gives_the_same_gradients_with_hash_routed_layers(v4, hf_dir):
    """recompute_granularity="full": megatron-core re-runs the layers (two at a time here, a hash-routed layer in
    each chunk) in the backward, after the forward unbound the token ids; the layers get them back through the
    checkpoint and the gradients are those of the run without recompute."""
    from megatron_patch.align.parity import random_tokens
    from megatron_patch.runtime.launch import run_local

    import megatron.core

    from megatron_patch.errors import UserError

    tokens = random_tokens(300, batch=2, seq=SEQ, seed=1)
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    if not megatron.core.__version__.startswith("0.16"):  # 0.19's recompute drops the ids: refused in one line
        with pytest.raises(UserError, match="full activation recomputation of DeepSeek-V4's layers needs"):
            run_local(gradients_worker, 1, str(hf_dir), tokens, full)
        return
    plain, recomputed = (run_local(gradients_worker, 1, str(hf_dir), tokens, r)[0] for r in ({}, full))
    assert plain.keys() == recomputed.keys() and any("router" in k for k in plain)
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=1e-5, atol=1e-6, msg=name)


# bf16 with transformers' float32 parameters (hyper-connections, sinks, position biases, norms): kept float32 through
# cast_parameters, and the bf16 error within 2x transformers' own bf16 error at every layer and the logits.
TOLERANCE = 2.0


def _float32_shapes(named_parameters) -> list[tuple]:
    return sorted(tuple(p.shape) for _, p in named_parameters if p.dtype == torch.float32)


def bf16_worker(hf: str, tokens: torch.Tensor):
    """The bf16 model's float32 parameter shapes after ``cast_parameters``, its layers' outputs ([b, s, n, h] streams)
    and its logits."""
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.checkpoint.model_io import load_hf_weights
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.blocks.inference import forward_logits
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.runtime import init_model_parallel
    from megatron_patch.models.blocks.precision import cast_parameters

    arch = parse_arch(hf)
    init_model_parallel(ParallelLayout())
    model = build_model(arch, ParallelLayout(), torch.bfloat16)
    cast_parameters([model], torch.bfloat16)
    load_hf_weights(model, arch, ParallelLayout(), HFCheckpointReader(hf))
    layers = []
    for layer in model.decoder.layers:
        layer.register_forward_hook(lambda m, i, o: layers.append(o[0].detach()))
    logits = forward_logits(model, tokens, arch.vocab_size)
    b, s = tokens.shape
    streams = [x.float().view(s, b, -1, x.shape[-1]).transpose(0, 1) for x in layers]
    return _float32_shapes(model.named_parameters()), streams, logits


def hf_run(hf_dir, tokens, dtype):
    from megatron_patch.models.description.hf_model import load_causal_lm

    model = load_causal_lm(hf_dir, dtype)
    layers = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda m, i, o: layers.append((o[0] if isinstance(o, tuple) else o).detach().float()))
    with torch.no_grad():
        logits = model(tokens).logits.float()
    return _float32_shapes(model.named_parameters()), layers, logits


def test_bf16_keeps_transformers_float32_parameters_and_its_rounding(v4, hf_dir):
    from megatron_patch.align.metrics import compare, compare_logits
    from megatron_patch.align.parity import random_tokens
    from megatron_patch.align.verdict import min_floor
    from megatron_patch.runtime.launch import run_local

    tokens = random_tokens(300, batch=2, seq=SEQ, seed=1)
    _, ref_layers, ref_logits = hf_run(hf_dir, tokens, torch.float32)
    hf_fp32_shapes, floor_layers, floor_logits = hf_run(hf_dir, tokens, torch.bfloat16)
    shapes, layers, logits = run_local(bf16_worker, 1, str(hf_dir), tokens)[0]
    assert shapes == hf_fp32_shapes and len(shapes) > 0
    points = [(f"layers.{i}", compare(r, t)["rel_l2"], compare(r, f)["rel_l2"])
              for i, (r, f, t) in enumerate(zip(ref_layers, floor_layers, layers, strict=True))]
    points.append(("logits", compare_logits(ref_logits, logits)["rel_l2"], compare_logits(ref_logits, floor_logits)["rel_l2"]))
    ratios = {name: ours / max(floor, min_floor("bf16")) for name, ours, floor in points}
    assert all(r <= TOLERANCE for r in ratios.values()), ratios


def test_the_launchers_follow_the_registry():
    """The launcher table is kept while the registry holds the same families: one read before a family being built
    is registered does not hide its launcher while it is (the whole suite's order did), nor after."""
    import dataclasses

    from megatron_patch.models.description.registry import get_family, registered_while_built
    from megatron_patch.training.launcher_args import launchers

    probe = dataclasses.replace(get_family("deepseek_v4"), name="probe_v4", hf_model_types=("probe_v4",))
    assert "probe_v4" not in launchers()
    with registered_while_built(probe):
        assert launchers()["probe_v4"].arg_names()[12:14] == ["ETP", "EP"]
    assert "probe_v4" not in launchers()


@pytest.mark.slow
def test_the_launcher_trains_the_converted_model_across_pipeline_and_expert_ranks(hf_dir_hash_on_both_stages, corpus,
                                                                                    tmp_path):
    """The issue's check: the converted tiny V4 (a hash-routed layer on each stage) trains through
    run_mcore_deepseek_v4.sh at PP=2 x EP=2, the streams crossing the stages forward and backward and the token ids
    reaching both stages' hash layers; the loss falls, and the checkpoint it saves converts back to an HF folder
    that holds the hash tables the run left alone."""
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.cli import main
    from tests.training_helpers import train_converted

    proc, losses = train_converted("deepseek_v4", hf_dir_hash_on_both_stages, corpus, tmp_path, None,
                                   {"MP_NPROC": "4"}, PP="2", EP="2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses
    back = tmp_path / "back"
    assert main(["convert", "mcore2hf", "--load-dir", str(tmp_path / "out" / "checkpoint"), "--save-dir", str(back),
                 "--quiet"]) == 0
    trained, start = HFCheckpointReader(back), HFCheckpointReader(hf_dir_hash_on_both_stages)
    for name in ("model.layers.1.ffn.gate.tid2eid", "model.layers.3.ffn.gate.tid2eid"):
        assert torch.equal(trained.get(name), start.get(name)), name
    assert not torch.equal(trained.get("model.layers.0.hc_attn_fn"), start.get("model.layers.0.hc_attn_fn"))


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])  # TP=2: a multi-process parity check
def test_generation_continues_the_window_and_the_compressed_entries_one_token_per_step(tp):
    """A generation with the runner's inference context gives the logits one whole forward gives, within float32
    noise: each layer keeps its last sliding_window - 1 keys/values, the entries (and the indexer's keys) of the
    windows that closed, and the inputs of the windows still open, and closes a window when its last token comes.
    A prompt of 10 tokens and 40 in all: the window of 8 slides, CSA's windows of 4 close on the prompt and on
    generated tokens past the indexer's top 4, HCA's of 8 too. And a generated token costs one token's forward:
    every layer sees the prompt once and then one token per step. The indexer has 8 heads here, not the tiny 2:
    with 2, ReLU leaves many entries' scores at exactly 0, and top-k breaks such ties by the row's length, which
    a cached step (the entries so far) and the whole forward (every entry, masked) do not share."""
    from megatron_patch.models.deepseek_v4.settings import CSA, HCA
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.models.description.tiny import tiny_config
    from tests.eval_helpers import check_generation_continues

    raw = tiny_config("deepseek_v4", index_n_heads=8)
    assert raw["sliding_window"] == 8 and raw["index_topk"] == 4 and raw["compress_rates"] == {CSA: 4, HCA: 8}
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, raw["vocab_size"], (2, 40), generator=generator).tolist()
    check_generation_continues(parse_arch(raw), tp, tokens, prompt=10)


@pytest.mark.slow
@pytest.mark.parametrize("distributed_optimizer", ["false", "true"])
def test_a_bf16_run_saves_and_resumes_exactly_with_its_float32_parameters(hf_dir, corpus, tmp_path,
                                                                         distributed_optimizer):
    """bf16 keeps transformers' float32 parameters (hyper-connections, sinks, norms) beside the bf16 ones: both of
    megatron-core's optimizers trained the model, then failed at the first save (an internal error: "Optimizer
    shape (24, 256) does not match model shape (32, 64)", or a size mismatch in the distributed optimizer), so no
    16-bit DeepSeek-V4 run could checkpoint. A run killed after its checkpoint and resumed repeats the whole run."""
    import shutil

    from tests.training_helpers import assert_a_killed_run_resumes_as_the_whole

    hf = shutil.copytree(hf_dir, tmp_path / "hf")  # the shared fixture is left without the corpus's tokenizer
    assert_a_killed_run_resumes_as_the_whole("deepseek_v4", hf, corpus, tmp_path, PR="bf16", LR="1e-3", MIN_LR="1e-4",
                                             DO=distributed_optimizer)
    # exported, the float32 parameters come back as the run held them, unrounded (transformers saves them so too);
    # mcore2hf wrote them in the checkpoint's bf16
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.cli import main

    back = tmp_path / "back"
    assert main(["convert", "mcore2hf", "--load-dir", str(tmp_path / "whole" / "checkpoint"), "--save-dir", str(back),
                 "--quiet"]) == 0
    exported = HFCheckpointReader(back)
    assert exported.dtype("model.layers.0.attn.wq_a.weight") == "bfloat16"
    for name in ("model.layers.0.attn.attn_sink", "model.layers.0.attn_norm.weight", "model.norm.weight"):
        trained = exported.get(name)
        assert trained.dtype == torch.float32 and not torch.equal(trained, trained.bfloat16().float()), name
