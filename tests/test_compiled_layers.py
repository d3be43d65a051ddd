"""MP_COMPILE=true (models/blocks/compiled_layers.py): every family's decoder layers are compiled, each kind of layer
whole where it traces to one graph, else its parts apart, decided at the kind's first call; the dry run says per
kind what was compiled and why. (The compiled model against the eager one within bf16's noise, with inductor's
kernels: tests/test_fp8.py's test_a_compiled_layer_equals_the_eager_one.)"""

from __future__ import annotations

import collections
import json
import sys

import pytest
import torch

from megatron_patch.cli import main
from megatron_patch.errors import UserError
from megatron_patch.models.blocks import compiled_layers
from megatron_patch.models.description.registry import families
from megatron_patch.runtime.launch import run_local
from tests.compile_helpers import layer_count_worker, traced_apart_worker
from tests.training_helpers import launcher_args


class Part(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.silu(self.linear(x))


class Opaque(torch.nn.Module):
    """A part with nothing in it that traces: it breaks the graph and holds no part of its own."""

    def forward(self, x):
        torch._dynamo.graph_break()
        return x * 2


class Layer(torch.nn.Module):
    def __init__(self, part=Part):
        super().__init__()
        self.self_attention, self.mlp = part(), part()

    def forward(self, x):
        x = x + self.self_attention(x)
        return x + self.mlp(x)


class BreakingLayer(Layer):
    """A layer whose own code breaks the graph between its parts, as megatron-core's MoE token dispatch does."""

    def forward(self, x):
        x = x + self.self_attention(x)
        torch._dynamo.graph_break()
        return x + self.mlp(x)


@pytest.fixture()
def traced(monkeypatch):
    """compile_modules with dynamo's graphs run as traced, counting: the classes whose forward was handed to
    torch.compile, and the graphs run."""
    handed, runs = collections.Counter(), []
    real = compiled_layers._compile

    def compile_counted(forward, compilation):
        handed[type(forward.__self__).__name__] += 1
        return real(forward, compilation)

    def backend(gm, example_inputs):
        def run(*args):
            runs.append(1)
            return gm.forward(*args)
        return run

    monkeypatch.setattr(compiled_layers, "_compile", compile_counted)
    torch._dynamo.reset()
    yield lambda layers, **kw: compiled_layers.compile_modules(
        [(f"decoder.layers.{i}", m) for i, m in enumerate(layers)], backend=backend, **kw), handed, runs
    torch._dynamo.reset()


def test_each_kind_is_compiled_whole_or_apart_once_decided_at_its_first_call(traced):
    """Three layers that trace whole and two that break between their parts: the first of each kind decides (one
    try of the whole), the others follow; the breaking kind's parts are compiled apart; every output is the eager
    one's, the state dict and classes are unchanged, and each kind is told once, with its first break."""
    compile_modules, handed, runs = traced
    torch.manual_seed(0)
    layers = [Layer(), BreakingLayer(), Layer(), BreakingLayer(), Layer()]
    for number, layer in enumerate(layers, 1):
        layer.layer_number = number
    x = torch.randn(4, 8)
    with torch.no_grad():
        eager = [layer(x) for layer in layers]
    keys = [list(layer.state_dict()) for layer in layers]
    told = []
    compilation = compile_modules(layers, on_decided=told.append)
    assert compilation.layers == 5 and [k.layers for k in compilation.kinds] == [[1, 3, 5], [2, 4]]
    with torch.no_grad():
        assert all(torch.equal(layer(x), e) for layer, e in zip(layers, eager))
    whole, apart = compilation.kinds
    assert (whole.plan.decision, apart.plan.decision) == ("whole", "apart")
    assert "graph_break" in apart.plan.reason and "test_compiled_layers.py" in apart.plan.reason, apart.plan.reason
    assert handed == {"Layer": 3, "BreakingLayer": 1, "Part": 4}
    assert told == [whole, apart]
    runs.clear()
    with torch.no_grad():
        assert all(torch.equal(layer(x), e) for layer, e in zip(layers, eager))
    assert len(runs) == 3 + 2 * 2  # three whole layers, two parts of each breaking one
    assert [list(layer.state_dict()) for layer in layers] == keys
    assert [type(layer) for layer in layers] == [Layer, BreakingLayer, Layer, BreakingLayer, Layer]
    assert apart.lines()[:3] == ["BreakingLayer(Part, Part) [layers 2, 4]: apart, 2 part(s) compiled",
                                 f"  first break: {apart.plan.reason}", "  compiled: self_attention, mlp"]
    assert whole.lines() == ["Layer(Part, Part) [layers 1, 3, 5]: whole (one graph)"]


def test_a_kind_of_which_nothing_compiles_is_refused_in_one_line(traced):
    compile_modules, _, _ = traced
    layer = BreakingLayer(part=Opaque)
    compile_modules([layer])
    with pytest.raises(UserError, match=r"^MP_COMPILE=true: no part of BreakingLayer\(Opaque, Opaque\) compiles as "
                                        r"one graph \(first break: .*\): drop MP_COMPILE$"):
        layer(torch.randn(2, 8))


def test_a_torch_without_error_on_graph_break_is_refused_in_one_line(monkeypatch):
    monkeypatch.delattr(torch._dynamo, "error_on_graph_break")
    with pytest.raises(UserError, match=r"^MP_COMPILE=true tries each kind of layer whole under torch._dynamo.error_on_"
                                        r"graph_break, which torch .* lacks \(2.9 and later have it\): upgrade torch "
                                        r"or drop MP_COMPILE$"):
        compiled_layers.compile_layers([Layer()])


def test_every_family_has_its_layers_compiled():
    """Every registered family's decoder layers (and MTP layers, where it builds them) are taken, whatever their
    class: DeepSeek-V4's own layer was left eager when only megatron-core's TransformerLayer was."""
    counts = run_local(layer_count_worker, 1)[0]
    assert set(counts) == set(families())
    for family, pairs in counts.items():
        for taken, layers in zip(pairs[::2], pairs[1::2]):
            assert taken == layers > 0, (family, pairs)


def test_deepseek_v4_layers_compiled_apart_train_as_eager():
    """V4's own layer class, four kinds (sliding / CSA / HCA attention, hash / top-k routing), each compiled apart
    around its MoE block's token dispatch: two training steps' logits and gradients equal the eager model's, every
    parameter still gets its gradient, and the dynamo graphs ran."""
    result = run_local(traced_apart_worker, 1, "deepseek_v4")[0]
    assert result["logits"] == 0 and result["grads"] == 0 and result["missing"] == [], result
    kinds = result["kinds"]
    assert [k["layers"] for k in kinds] == [[1], [2], [3], [4]], result["lines"]
    for kind in kinds:
        assert kind["decision"] == "apart" and kind["reason"], kind
        assert {"self_attention", "mlp.router", "input_layernorm", "attn_hc"} <= set(kind["compiled"]), kind
    assert result["graphs_run"] > 0


def _dry_run(monkeypatch, capsys, tmp_path, family="mixtral", **over) -> dict:
    prefix = tmp_path / "corpus_text_document"
    for suffix in (".bin", ".idx"):
        (tmp_path / f"corpus_text_document{suffix}").write_bytes(b"")
    monkeypatch.setenv("MP_COMPILE", "true")
    monkeypatch.setenv("MP_DRY_RUN", "json")
    args = launcher_args(family, **{"PR": "bf16", "FL": "true", "DATASET_PATH": str(prefix),
                                    "OUTPUT_BASEPATH": str(tmp_path / "out"), **over})
    assert main(["train", family, *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_dry_run_says_what_is_compiled_of_each_kind(monkeypatch, capsys, tmp_path):
    """Mixtral's tiny model (FL=true: torch SDPA) breaks in its MoE block (the router's auxiliary loss, then the
    token dispatch), so its attention, norms and experts are compiled apart, and the dry run names that first
    break."""
    from megatron_patch.cli.train import print_dry_run

    report = _dry_run(monkeypatch, capsys, tmp_path)
    [kind] = report["compile"]["kinds"]
    assert (kind["label"], kind["decision"], kind["layers"]) == ("TransformerLayer(SelfAttention, MoELayer)", "apart",
                                                                 [1, 2, 3, 4])
    assert "(moe/" in kind["reason"], kind
    assert {"self_attention", "input_layernorm", "pre_mlp_layernorm", "mlp.experts.local_experts.*"} <= \
        set(compiled_layers._collapse(kind["compiled"])), kind
    print_dry_run(report)
    text = capsys.readouterr().out
    assert "  compile     per kind of layer, as the tiny mixtral model's first step decides it" in text
    assert "    TransformerLayer(SelfAttention, MoELayer) [layers 1-4]: apart, " in text
    assert f"      first break: {kind['reason']}" in text
    assert "      compiled: input_layernorm, self_attention, pre_mlp_layernorm, " in text


def test_the_dry_run_says_where_the_runs_layers_break_unlike_the_tiny_model(monkeypatch, capsys, tmp_path, corpus):
    """The tiny model is measured at TP=1 without recompute: at TP=2 without SP (the tensor-parallel linears) and with
    AC=sel (get_rng_state) the run's layers compile apart where the dry run said whole (the fp8 audit, fp8b #6 and
    #9), and at TP=2 with SP where the column-parallel linears are not in float8 (the cmp audit)."""
    from megatron_patch.cli.train import print_dry_run

    monkeypatch.setenv("MP_NPROC", "2")
    report = _dry_run(monkeypatch, capsys, tmp_path, "llama3_1", TP="2", AC="sel")
    caveats = report["compile"]["unlike_the_run"]
    assert len(caveats) == 2 and caveats[0].startswith("at TP=2 without SP megatron-core's tensor-parallel linears "
                                                       "break a layer's graph (the column-parallel linears' "
                                                       "asynchronous all-reduce), so"), caveats
    assert caveats[1].startswith("AC=sel's recompute of core attention breaks the graph (torch.get_rng_state)")
    print_dry_run(report)
    assert f"    unlike this run's layers: {caveats[0]}\n" in capsys.readouterr().out
    # with SP the column-parallel linears gather the sequence asynchronously in their backward: apart too (the cmp
    # audit measured linear_qkv and linear_fc1 eager, the MLP apart, where this dry run said whole)
    sequence_parallel = _dry_run(monkeypatch, capsys, tmp_path, "llama3_1", TP="2", SP="true")["compile"]
    assert [c.split(" break")[0] for c in sequence_parallel["unlike_the_run"]] == [
        "at TP=2 with SP megatron-core's column-parallel linears (those not in float8)"], sequence_parallel
    assert _dry_run(monkeypatch, capsys, tmp_path)["compile"]["unlike_the_run"] == []
    monkeypatch.setenv("MP_SFT_PACKING", "true")  # the cmp audit: rope_utils' _local_scalar_dense, attention apart
    monkeypatch.setenv("MP_TOKENIZER", str(corpus["tok"]))
    packed = _dry_run(monkeypatch, capsys, tmp_path, "llama3_1", DATASET_PATH=str(corpus["prefix"]))
    assert packed["compile"]["unlike_the_run"] == [
        "MP_SFT_PACKING's packed sequences break the graph (RoPE and attention per document read each document's "
        "length), so whole layers compile apart there"]


def test_the_dry_run_refuses_a_family_that_does_not_compile(monkeypatch, capsys, tmp_path):
    def refuse(*args):
        raise UserError("MP_COMPILE=true: no part of X compiles as one graph (first break: y): drop MP_COMPILE")

    monkeypatch.setattr(compiled_layers, "family_compile_report", refuse)
    report = _dry_run(monkeypatch, capsys, tmp_path)
    assert report["compile"] == {"refused": "MP_COMPILE=true: no part of X compiles as one graph (first break: y): "
                                            "drop MP_COMPILE"}
    assert report["compile"]["refused"] in report["machine_problems"]


def test_lazy_modules_are_bound_in_their_owners_before_layers_compile(monkeypatch):
    """LoRA's adapters reach torch through the weight splits' ``LazyModule``, whose import at first use broke a
    compiled layer's graph: the dry run said 'whole (one graph)', the run compiled 7 parts. ``compile_layers``
    resolves every lazy module into its owner's globals first."""
    import types

    from megatron_patch.lazy import LazyModule, resolve_all

    owner = types.ModuleType("mp_lazy_owner")
    monkeypatch.setitem(sys.modules, "mp_lazy_owner", owner)
    owner.torch = LazyModule("torch", "mp_lazy_owner")
    exec("def twice(x):\n    return torch.cat([x, x])", owner.__dict__)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="import_module|graph break|Unsupported"):
        with torch._dynamo.error_on_graph_break(True):
            torch.compile(owner.twice, backend="eager")(torch.ones(2))
    resolve_all()
    assert owner.torch is torch
    torch._dynamo.reset()
    with torch._dynamo.error_on_graph_break(True):
        assert torch.compile(owner.twice, backend="eager")(torch.ones(2)).tolist() == [1.0] * 4


@pytest.mark.slow
def test_each_pipeline_stage_says_what_it_compiled(corpus, tmp_path):
    """At PP=2 rank 0 alone said what was compiled: Qwen3-MoE's dense first layer on stage 0, and nothing of the MoE
    layers on stage 1 (the cmp audit). Each stage's first rank says its own layers, naming the stage."""
    from tests.training_helpers import launch

    args = launcher_args("qwen3_moe", PP="2", FL="true", DATASET_PATH=str(corpus["prefix"]),
                         OUTPUT_BASEPATH=str(tmp_path / "out"), TRAIN_TOKENS_OR_ITERS=str(2 * 512),
                         WARMUP_TOKENS_OR_ITERS="0", SAVE_INTERVAL="100")
    proc = launch(args, {"MP_COMPILE": "true", "MP_PP0_LAYERS": "1", "MP_SAVE": "false"}, family="qwen3_moe")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if "torch.compile" in line]
    assert "pipeline stage 0: torch.compile (MP_COMPILE): 1 decoder layers of 1 kind(s)," in proc.stdout, said
    assert "pipeline stage 1: torch.compile (MP_COMPILE): 3 decoder layers of 1 kind(s)," in proc.stdout, said
    assert any(line.startswith("pipeline stage 0: torch.compile: TransformerLayer(SelfAttention, MLP) [layers 1]: ")
               for line in said), said
    assert any(line.startswith("pipeline stage 1: torch.compile: TransformerLayer(SelfAttention, MoELayer) "
                               "[layers 2-4]: ") for line in said), said
