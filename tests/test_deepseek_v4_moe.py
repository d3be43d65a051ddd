"""DeepSeek-V4's MoE block (models/deepseek_v4/moe.py) against transformers' DeepseekV4SparseMoeBlock: a ``moe``
layer (sqrtsoftplus top-k with the expert bias) and a ``hash_moe`` layer (experts looked up in ``tid2eid`` by token
id, weighted by the gate), clamped SwiGLU experts and the shared expert, forward and input gradients within fp32
noise; at EP=2 as at EP=1; ``tid2eid`` a buffer; each piece shown to matter; a hash layer without token ids refused.
"""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_patch.align.parity import FP32_REL_L2
from megatron_patch.errors import UserError
from megatron_patch.runtime.distributed import ParallelLayout
from megatron_patch.runtime.launch import run_local

# A tiny V4: 4 experts of 16 (top-2) and a shared one, hidden 32, a hash layer then a top-k one. The weights are
# drawn larger than transformers' init (std 0.02) so that the SwiGLU clamp (0.4) bites on most activations.
HF = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
          n_shared_experts=1, num_hidden_layers=2, mlp_layer_types=["hash_moe", "moe"], swiglu_limit=0.4,
          routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", num_attention_heads=4, head_dim=32,
          num_key_value_heads=1, q_lora_rank=16, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16)
BATCH, SEQ = 2, 8
RECOMPUTE = dict(recompute_granularity="selective", recompute_modules=["moe"])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def hf_block(layer: int, seed: int):
    """transformers' block of ``layer`` with seeded weights, expert bias and hash table."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    config = DeepseekV4Config(**HF)
    config._experts_implementation = "eager"
    block = DeepseekV4SparseMoeBlock(config, layer).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "gate." in name else 0.5))
        if block.is_hash:  # k distinct experts per token, as the hub's tables have
            block.gate.tid2eid.copy_(torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(64)]))
        else:
            block.gate.e_score_correction_bias.copy_(torch.randn(4, generator=g) * 0.3)
    return block


def hf_run(block, x: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor):
    x = x.clone().requires_grad_(True)
    out = block(x, input_ids=ids)
    out.backward(grad)
    return out.detach(), x.grad


def moe_layer(mlp_layer_type: str, state: dict, layout=None, **changes):
    """Our block with transformers' weights (``state``), this rank's part of them under ``layout``; ``changes``:
    settings of the variant (``scoring`` the router's, the rest the TransformerConfig's)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from megatron_patch.models.deepseek_v4 import moe
    from megatron_patch.runtime import ParallelLayout

    layout = layout or ParallelLayout()
    scoring = changes.pop("scoring", "sqrtsoftplus")
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, add_bias_linear=False, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=layout.tp, sequence_parallel=layout.tp > 1, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp, moe_token_dispatcher_type="alltoall",
        **{**moe.moe_config_kwargs(HF), **changes})
    spec = moe.moe_spec(mlp_layer_type, scoring, HF["vocab_size"])
    # megatron-core 0.19's specs are partials of the class, 0.16's ModuleSpecs
    build = spec if isinstance(spec, functools.partial) else functools.partial(build_module, spec)
    layer = build(config=config, layer_number=1)
    own = layer.state_dict()
    first = layer.local_expert_indices[0]
    tp, rank = layer.tp_group.size(), layer.tp_group.rank()
    with torch.no_grad():
        for w in moe.weight_names(mlp_layer_type, HF["n_routed_experts"]):
            name, _, rest = w.mcore.partition("local_experts.")
            tensor = moe.transformers_tensor(state, w)
            if rest:  # this EP rank holds experts first.. under local numbers (whole: ETP is 1)
                e, _, tail = rest.partition(".")
                if not 0 <= int(e) - first < layer.num_local_experts:
                    continue
                name = f"{name}local_experts.{int(e) - first}.{tail}"
            elif name.startswith("shared_experts.linear_fc1"):  # column-parallel, each half its rows
                tensor = torch.cat([half.chunk(tp)[rank] for half in tensor.chunk(2)])
            elif name.startswith("shared_experts.linear_fc2"):  # row-parallel
                tensor = tensor.chunk(tp, dim=1)[rank]
            own[name].copy_(tensor)
    return layer


def mcore_run(layer, x: torch.Tensor, ids: torch.Tensor | None, grad: torch.Tensor):
    """Output and input gradient [b, s, h] of this rank's tokens: under sequence parallelism its part of the
    sequence, the token ids bound whole. The backward runs after the ids are unbound."""
    from megatron_patch.models.deepseek_v4 import moe

    tp, rank = layer.tp_group.size(), layer.tp_group.rank()
    x = x.transpose(0, 1).chunk(tp)[rank].contiguous().requires_grad_(True)  # [s, b, h]
    with moe.routing_token_ids(ids):
        out, _ = layer(x)
    out.backward(grad.transpose(0, 1).chunk(tp)[rank])
    return out.detach().transpose(0, 1), x.grad.transpose(0, 1)


def block_worker(layout, runs: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each run: a variant of our block on this rank's micro-batch (by its data-parallel rank) -> its output and
    input gradient."""
    from megatron.core import parallel_state

    from megatron_patch.runtime import init_model_parallel

    init_model_parallel(layout)
    batch = parallel_state.get_data_parallel_rank()
    out = []
    for run in runs:
        layer = moe_layer(run["type"], run["state"], layout, **run.get("changes", {}))
        out.append(mcore_run(layer, run["x"][batch], run["ids"][batch], run["grad"][batch]))
    return out


def inputs(seed: int, ranks: int = 1):
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(BATCH, SEQ, 32, generator=g) for _ in range(ranks)],
            [torch.randint(0, 64, (BATCH, SEQ), generator=g) for _ in range(ranks)],
            [torch.randn(BATCH, SEQ, 32, generator=g) for _ in range(ranks)])


@pytest.fixture(scope="module")
def blocks():
    return {"hash_moe": hf_block(0, seed=1), "moe": hf_block(1, seed=2)}


def test_the_config_is_read_as_transformers_fills_it_in_and_what_cannot_be_built_is_refused():
    from transformers import DeepseekV4Config

    from megatron_patch.models.deepseek_v4.moe import mlp_layer_types_of, moe_config_kwargs

    for over in ({}, {"num_hash_layers": 1}, {"num_hash_layers": 0}, {"num_hidden_layers": 2},
                 {"mlp_layer_types": ["moe", "hash_moe", "moe", "moe"]}):
        raw = {"num_hidden_layers": 4, **over}
        assert list(mlp_layer_types_of(raw)) == DeepseekV4Config(**raw).mlp_layer_types, over
    kwargs = moe_config_kwargs(HF)
    assert (kwargs["num_moe_experts"], kwargs["moe_router_topk"], kwargs["moe_ffn_hidden_size"],
            kwargs["moe_shared_expert_intermediate_size"], kwargs["activation_func_clamp_value"],
            kwargs["moe_router_topk_scaling_factor"]) == (4, 2, 16, 16, 0.4, 1.5)
    for over, message in (({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
                          ({"mlp_bias": True}, "mlp_bias=true is not supported"),
                          ({"scoring_func": "tanh"}, "scoring_func='tanh' is not supported"),
                          ({"n_routed_experts": None}, "lacks 'n_routed_experts'")):
        with pytest.raises(UserError, match=message):
            moe_config_kwargs({**HF, **over})
    with pytest.raises(UserError, match="each hash_moe or moe"):
        mlp_layer_types_of({"num_hidden_layers": 2, "mlp_layer_types": ["dense", "moe"]})


def test_the_block_is_transformers_and_each_piece_matters(blocks):
    """Forward and input gradients within fp32 noise for a hash and a top-k layer, with megatron-core's activation
    recompute too; without the clamp, with softmax scores, with a permuted hash table or without the expert bias,
    far off."""
    xs, ids, grads = inputs(3)
    want = {t: hf_run(b, xs[0], ids[0], grads[0]) for t, b in blocks.items()}
    hidden = blocks["moe"].experts.gate_up_proj.detach()
    pre = torch.einsum("bsh,eih->bsei", xs[0], hidden)
    assert (pre.abs() > HF["swiglu_limit"]).float().mean() > 0.3  # the clamp bites

    state = {t: b.state_dict() for t, b in blocks.items()}
    permuted = {**state["hash_moe"], "gate.tid2eid": state["hash_moe"]["gate.tid2eid"].roll(1, dims=0)}
    unbiased = {**state["moe"], "gate.e_score_correction_bias": torch.zeros(4)}
    runs = {
        "hash_moe": dict(type="hash_moe", state=state["hash_moe"]),
        "moe": dict(type="moe", state=state["moe"]),
        # megatron-core's activation recompute of the block: the backward runs after the ids are unbound
        "hash_moe, recomputed": dict(type="hash_moe", state=state["hash_moe"], changes=RECOMPUTE),
        "moe, recomputed": dict(type="moe", state=state["moe"], changes=RECOMPUTE),
        "hash_moe, no clamp": dict(type="hash_moe", state=state["hash_moe"],
                                   changes=dict(activation_func_clamp_value=None)),
        "moe, no clamp": dict(type="moe", state=state["moe"], changes=dict(activation_func_clamp_value=None)),
        "moe, softmax": dict(type="moe", state=state["moe"], changes=dict(scoring="softmax")),
        "hash_moe, softmax": dict(type="hash_moe", state=state["hash_moe"], changes=dict(scoring="softmax")),
        "hash_moe, permuted table": dict(type="hash_moe", state=permuted),
        "moe, no expert bias": dict(type="moe", state=unbiased),
    }
    for run in runs.values():
        run.update(x=xs, ids=ids, grad=grads)
    got = dict(zip(runs, run_local(block_worker, 1, ParallelLayout(), list(runs.values()))[0]))
    exact = ("hash_moe", "moe", "hash_moe, recomputed", "moe, recomputed")
    for name in exact:
        (out, dx), (want_out, want_dx) = got[name], want[name.split(",")[0]]
        assert _rel(out, want_out) <= FP32_REL_L2 and _rel(dx, want_dx) <= FP32_REL_L2, name
    for name in runs.keys() - set(exact):
        assert _rel(got[name][0], want[name.split(",")[0]][0]) > 100 * FP32_REL_L2, name


def buffer_worker() -> dict:
    """tid2eid as the block holds it, before and after an optimizer step; a hash layer run without ids."""
    from megatron_patch.runtime import ParallelLayout, init_model_parallel

    init_model_parallel(ParallelLayout())
    hashed = moe_layer("hash_moe", hf_block(0, seed=1).state_dict())
    table = hashed.router.tid2eid.clone()
    sharded = {k: v.dtype for k, v in hashed.sharded_state_dict(prefix="mlp.").items() if k.startswith("mlp.router.")}
    optimizer = torch.optim.SGD(hashed.parameters(), lr=1.0)
    xs, ids, grads = inputs(4)
    mcore_run(hashed, xs[0], ids[0], grads[0])
    optimizer.step()
    try:
        hashed(xs[0].transpose(0, 1).contiguous())
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    try:
        moe_layer("moe", {}, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3)
        aux_refused = ""
    except UserError as exc:
        aux_refused = str(exc)
    topk = moe_layer("moe", hf_block(1, seed=2).state_dict())

    def planted(edit) -> str:  # what a step says of a table edited as a checkpoint could hold it
        kept = hashed.router.tid2eid.clone()
        with torch.no_grad():
            edit(hashed.router.tid2eid)
        try:
            mcore_run(hashed, xs[0], ids[0], grads[0])
            return ""
        except UserError as exc:
            return str(exc)
        finally:
            with torch.no_grad():
                hashed.router.tid2eid.copy_(kept)

    experts = hashed.config.num_moe_experts
    return dict(
        out_of_range=planted(lambda t: t.__setitem__((3, 0), experts)), negative=planted(lambda t: t.__setitem__((3, 0), -1)),
        twice=planted(lambda t: t[5].fill_(int(t[5, 0]))), restored=planted(lambda t: None), experts=experts,
        params=[n for n, _ in hashed.named_parameters()],
        state={k: v.dtype for k, v in hashed.state_dict().items() if torch.is_tensor(v)},
        in_optimizer=any(p is hashed.router.tid2eid for g in optimizer.param_groups for p in g["params"]),
        unchanged=torch.equal(table, hashed.router.tid2eid), gate_moved=hashed.router.weight.grad is not None,
        refused=refused, aux_refused=aux_refused, sharded=sharded,
        topk_state=sorted(k for k in topk.state_dict() if k.startswith("router.")),
        bf16_dtype=hashed.bfloat16().router.tid2eid.dtype, hash_has_bias=hasattr(hashed.router, "expert_bias"))


def test_tid2eid_is_a_buffer_kept_in_the_checkpoint_that_no_optimizer_sees():
    got = run_local(buffer_worker, 1)[0]
    assert "router.tid2eid" not in got["params"] and "router.weight" in got["params"]
    assert got["state"]["router.tid2eid"] == torch.int32 and got["bf16_dtype"] == torch.int32
    assert not got["in_optimizer"] and got["unchanged"] and got["gate_moved"]
    # megatron-core's distributed checkpoint (torch_dist) keeps it too, as it is
    assert got["sharded"] == {"mlp.router.weight": torch.float32, "mlp.router.tid2eid": torch.int32}
    assert "routes by token id (hash_moe) but no token ids are bound" in got["refused"]
    # a checkpoint's table naming an expert the layer lacks was an internal error in the first step, one naming an
    # expert twice for a token trained another model than transformers' silently (the dsa audit): refused in one line
    assert got["out_of_range"].endswith(f"tid2eid names expert {got['experts']}, and the layer has {got['experts']} (0 "
                                        f"to {got['experts'] - 1}): the checkpoint is damaged or not this model's")
    assert f"tid2eid names expert -1, and the layer has {got['experts']}" in got["negative"]
    assert "tid2eid names one expert twice for token 5 (" in got["twice"] and got["restored"] == ""
    assert got["aux_refused"].startswith("DeepSeek-V4's router does not support an auxiliary loss")
    # the top-k layer keeps transformers' e_score_correction_bias as megatron-core's expert bias; a hash layer has none
    assert got["topk_state"] == ["router.expert_bias", "router.weight"] and not got["hash_has_bias"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [ParallelLayout(ep=2), ParallelLayout(tp=2, ep=2, etp=1)], ids=str)
def test_expert_parallel_2_is_transformers_on_each_ranks_tokens(blocks, layout):
    """At EP=2 (each rank 2 of the 4 experts, alltoall dispatch) each rank's own micro-batch comes out as
    transformers computes it, as at EP=1; with TP=2 and sequence parallelism too, each rank routing its half of
    the sequence by its half of the token ids."""
    ranks = 2 // layout.tp  # micro-batches: one per data-parallel rank
    xs, ids, grads = inputs(5, ranks=ranks)
    runs = [dict(type=t, state=b.state_dict(), x=xs, ids=ids, grad=grads) for t, b in blocks.items()]
    got = run_local(block_worker, 2, layout, runs)
    for rank in range(2):
        batch, part = rank // layout.tp, rank % layout.tp
        for run, (out, dx) in zip(runs, got[rank]):
            want = hf_run(blocks[run["type"]], xs[batch], ids[batch], grads[batch])
            want_out, want_dx = (t.chunk(layout.tp, dim=1)[part] for t in want)
            assert _rel(out, want_out) <= FP32_REL_L2 and _rel(dx, want_dx) <= FP32_REL_L2, (rank, run["type"])
