"""DeepSeek-V4's hyper-connections against transformers' own modules, with the same (seeded, random) weights and
inputs, ours sequence-first: the mixes, a decoder layer's residual logic around stand-in sublayers, the model's
expansion into streams and its collapse; forward and gradients within fp32 noise. The Sinkhorn-Knopp iterations and
their epsilon change the result beyond that noise, so the tests would see them computed otherwise. Between pipeline
stages the streams fit the tensor megatron-core's schedule allocates when it is given micro_batch_size * hc_mult."""

from types import SimpleNamespace

import pytest
import torch

from megatron_patch.models.deepseek_v4.config import TINY_CONFIG, parse_config
from megatron_patch.models.deepseek_v4.hyper_connections import (
    HyperConnectedLayer, HyperConnection, HyperHead, RMSNorm, expand_streams, pipeline_schedule_sizes,
    stage_input_to_streams, streams_to_stage_output)
from megatron_patch.models.deepseek_v4.settings import settings

modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DeepseekV4Config  # noqa: E402  (after the skip: only with transformers' DeepSeek-V4)

TOLERANCE = 1e-5
BATCH, SEQ = 2, 5


def rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.double() - theirs.double()).norm() / theirs.double().norm().clamp_min(1e-30)).item()


def hf_config(**change) -> DeepseekV4Config:
    return DeepseekV4Config(**{**TINY_CONFIG, **change})


def ours_config(hf: DeepseekV4Config, sequence_parallel: bool = False):
    """What the modules read of megatron-core's TransformerConfig, and the family's settings."""
    config = SimpleNamespace(hidden_size=hf.hidden_size, layernorm_epsilon=hf.rms_norm_eps,
                             sequence_parallel=sequence_parallel, init_method_std=0.02)
    return config, settings(parse_config(hf.to_dict()))


def randomise(module: torch.nn.Module, seed: int) -> None:
    """Weights far from their initialisation (mixes that are not near constants, norms that are not ones)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.1 if p.dim() > 1 else 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if "scale" in name or "norm" in name else 0.0))


def copy_into(ours: torch.nn.Module, theirs: torch.nn.Module, names: dict[str, str]) -> None:
    state = theirs.state_dict()
    ours.load_state_dict({mine: state[hf] for mine, hf in names.items()}, strict=True)


HC_NAMES = {"fn": "fn", "base": "base", "scale": "scale"}
HEAD_NAMES = {"fn": "hc_fn", "base": "hc_base", "scale": "hc_scale"}


def streams(hf: DeepseekV4Config, seed: int = 1, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The same streams batch-first (transformers') and sequence-first (ours), both leaves."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, SEQ, hf.hc_mult, hf.hidden_size, generator=gen).to(dtype)
    return x.clone().requires_grad_(), x.transpose(0, 1).contiguous().requires_grad_()


def backward_of(outputs, seed: int = 7) -> None:
    """Backward from a random weighting of every output (the same for both: outputs given batch-first)."""
    gen = torch.Generator().manual_seed(seed)
    sum(((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in outputs)).backward()


def sf(x: torch.Tensor) -> torch.Tensor:
    """Sequence-first ours as transformers' batch-first."""
    return x.transpose(0, 1)


def _twins(theirs_class, ours_class, names: dict, seed: int):
    """transformers' module with random weights (``seed``), ours with the same, and one input to each."""
    hf = hf_config()
    theirs = theirs_class(hf)
    randomise(theirs, seed=seed)
    ours = ours_class(*ours_config(hf))
    copy_into(ours, theirs, names)
    return theirs, ours, *streams(hf, seed=seed + 1)


def test_the_mixes_are_transformers_forward_and_backward():
    theirs, ours, x_hf, x = _twins(modeling.DeepseekV4HyperConnection, HyperConnection, HC_NAMES, seed=0)
    post_hf, comb_hf, collapsed_hf = theirs(x_hf)
    post, comb, collapsed = ours(x)
    for mine, their in ((post, post_hf), (comb, comb_hf), (collapsed, collapsed_hf)):
        assert rel(sf(mine), their) <= TOLERANCE
    # comb is near doubly stochastic: its columns were normalised last, its rows converge over the iterations
    assert torch.allclose(comb.sum(-2), torch.ones(()), atol=1e-5)
    assert torch.allclose(comb.sum(-1), torch.ones(()), atol=1e-2)
    backward_of([post_hf, comb_hf, collapsed_hf])
    backward_of([sf(post), sf(comb), sf(collapsed)])
    assert rel(sf(x.grad), x_hf.grad) <= TOLERANCE
    for mine, their in HC_NAMES.items():
        assert rel(getattr(ours, mine).grad, getattr(theirs, their).grad) <= TOLERANCE, mine


def test_the_head_is_transformers_forward_and_backward():
    theirs, ours, x_hf, x = _twins(modeling.DeepseekV4HyperHead, HyperHead, HEAD_NAMES, seed=2)
    out_hf, out = theirs(x_hf), ours(x)
    assert rel(sf(out), out_hf) <= TOLERANCE
    backward_of([out_hf])
    backward_of([sf(out)])
    assert rel(sf(x.grad), x_hf.grad) <= TOLERANCE
    for mine, their in HEAD_NAMES.items():
        assert rel(getattr(ours, mine).grad, getattr(theirs, their).grad) <= TOLERANCE, mine


class StandIn(torch.nn.Module):
    """A sublayer standing in for the attention or the MoE block: [.., h] -> [.., h], the same in both models."""

    def __init__(self, hidden: int, seed: int, returns_pair: bool):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.linear = torch.nn.Linear(hidden, hidden)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5)
            self.linear.bias.copy_(torch.randn(hidden, generator=gen) * 0.1)
        self.returns_pair = returns_pair  # transformers' attention returns (output, weights)

    def forward(self, x, *args, **kwargs):
        out = torch.tanh(self.linear(x)) * 2
        return (out, None) if self.returns_pair else out


LAYER_NAMES = {"input_layernorm.weight": "input_layernorm.weight",
               "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
               **{f"{hc}.{mine}": f"{hc}.{their}" for hc in ("attn_hc", "ffn_hc") for mine, their in HC_NAMES.items()}}


def layer_pair(hf: DeepseekV4Config, seed: int = 4):
    """transformers' decoder layer with stand-ins for its attention and MLP, and ours with the same weights."""
    theirs = modeling.DeepseekV4DecoderLayer(hf, layer_idx=2)
    theirs.self_attn = StandIn(hf.hidden_size, seed=10, returns_pair=True)
    theirs.mlp = StandIn(hf.hidden_size, seed=11, returns_pair=False)
    for name in ("input_layernorm", "post_attention_layernorm", "attn_hc", "ffn_hc"):
        randomise(getattr(theirs, name), seed=seed + len(name))
    ours = HyperConnectedLayer(*ours_config(hf))
    copy_into(ours, theirs, LAYER_NAMES)
    return theirs, ours


def run_layer(theirs, ours, hf, dtype=torch.float32):
    x_hf, x = streams(hf, seed=5, dtype=dtype)
    out_hf = theirs(x_hf)
    # our sublayers are called with [s, b, h]: the stand-ins act on the last dimension, as the real ones on theirs
    out = ours(x, attention=lambda y: theirs.self_attn(y)[0], mlp=theirs.mlp)
    return x_hf, x, out_hf, out


def test_a_decoder_layer_is_transformers_forward_and_backward():
    hf = hf_config()
    theirs, ours = layer_pair(hf)
    x_hf, x, out_hf, out = run_layer(theirs, ours, hf)
    assert rel(sf(out), out_hf) <= TOLERANCE
    backward_of([out_hf])
    stand_in_grads = [p.grad.clone() for p in (*theirs.self_attn.parameters(), *theirs.mlp.parameters())]
    for p in (*theirs.self_attn.parameters(), *theirs.mlp.parameters()):
        p.grad = None
    backward_of([sf(out)])
    assert rel(sf(x.grad), x_hf.grad) <= TOLERANCE
    for mine, their in LAYER_NAMES.items():
        assert rel(ours.get_parameter(mine).grad, theirs.get_parameter(their).grad) <= TOLERANCE, mine
    # the sublayers' gradients too: they see the same inputs and the same output gradients
    for grad, p in zip(stand_in_grads, (*theirs.self_attn.parameters(), *theirs.mlp.parameters())):
        assert rel(p.grad, grad) <= TOLERANCE


def test_a_decoder_layer_in_bfloat16_is_transformers():
    """bf16 streams and sublayers, the mixes and the norms' weights in float32 (as transformers keeps them)."""
    hf = hf_config()
    theirs, ours = layer_pair(hf)
    theirs.self_attn.to(torch.bfloat16)
    theirs.mlp.to(torch.bfloat16)
    _, _, out_hf, out = run_layer(theirs, ours, hf, dtype=torch.bfloat16)
    assert out.dtype == out_hf.dtype == torch.bfloat16
    assert torch.equal(sf(out), out_hf)


def test_the_model_expands_the_embedding_and_collapses_the_streams_as_transformers():
    """transformers' DeepseekV4Model with stand-ins for every attention and MLP: its last hidden state is ours,
    embedding -> streams -> layers -> hc_head -> final norm."""
    hf = hf_config(num_hidden_layers=2, layer_types=TINY_CONFIG["layer_types"][:2],
                   mlp_layer_types=TINY_CONFIG["mlp_layer_types"][:2])
    torch.manual_seed(0)
    theirs = modeling.DeepseekV4Model(hf).eval()
    config, s = ours_config(hf)
    layers = []
    for i, layer in enumerate(theirs.layers):
        layer.self_attn = StandIn(hf.hidden_size, seed=20 + i, returns_pair=True)
        layer.mlp = StandIn(hf.hidden_size, seed=30 + i, returns_pair=False)
        for name in ("input_layernorm", "post_attention_layernorm", "attn_hc", "ffn_hc"):
            randomise(getattr(layer, name), seed=40 + 4 * i + len(name))
        ours_layer = HyperConnectedLayer(config, s)
        copy_into(ours_layer, layer, LAYER_NAMES)
        layers.append(ours_layer)
    randomise(theirs.hc_head, seed=50)
    randomise(theirs.norm, seed=51)
    head, norm = HyperHead(config, s), RMSNorm(config)
    copy_into(head, theirs.hc_head, HEAD_NAMES)
    copy_into(norm, theirs.norm, {"weight": "weight"})

    tokens = torch.randint(0, hf.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = theirs(input_ids=tokens).last_hidden_state
        x = expand_streams(theirs.embed_tokens(tokens).transpose(0, 1), hf.hc_mult)
        assert x.shape == (SEQ, BATCH, hf.hc_mult, hf.hidden_size) and x.is_contiguous()
        for ours_layer, layer in zip(layers, theirs.layers):
            x = ours_layer(x, attention=lambda y, m=layer.self_attn: m(y)[0], mlp=layer.mlp)
        got = norm(head(x))
    assert rel(sf(got), expected) <= TOLERANCE


@pytest.mark.parametrize("change", [{"hc_sinkhorn_iters": 3}, {"hc_sinkhorn_iters": 1}, {"hc_eps": 1e-3}])
def test_the_sinkhorn_iterations_and_their_epsilon_change_the_layer_beyond_tolerance(change):
    """The same weights and inputs with fewer Sinkhorn-Knopp iterations or another floor: an implementation that
    computed them otherwise would fail the comparisons above."""
    hf = hf_config()
    theirs, ours = layer_pair(hf)
    _, _, reference, _ = run_layer(theirs, ours, hf)
    other_theirs, other = layer_pair(hf_config(**change))
    _, _, other_hf, moved = run_layer(other_theirs, other, hf_config(**change))
    assert rel(sf(moved), other_hf) <= TOLERANCE  # still transformers' own, with its settings
    assert rel(sf(moved), reference) > 100 * TOLERANCE


def test_parameters_are_float32_and_summed_over_tp_under_sequence_parallelism():
    hf = hf_config()
    for sp in (False, True):
        config, s = ours_config(hf, sequence_parallel=sp)
        layer, head = HyperConnectedLayer(config, s), HyperHead(config, s)
        params = [*layer.parameters(), *head.parameters()]
        assert len(params) == 4 * 2 + 3 and all(p.dtype == torch.float32 for p in params)
        assert all(getattr(p, "sequence_parallel", None) is sp for p in params)
    assert {n: tuple(p.shape) for n, p in layer.attn_hc.named_parameters()} == {
        "fn": ((2 + 4) * 4, 4 * 64), "base": ((2 + 4) * 4,), "scale": (3,)}
    assert {n: tuple(p.shape) for n, p in head.named_parameters()} == {"fn": (4, 4 * 64), "base": (4,), "scale": (1,)}


@pytest.mark.parametrize("sequence_parallel, tp, cp", [(False, 1, 1), (True, 2, 1), (False, 1, 2)])
def test_streams_fit_the_tensor_megatron_core_sends_between_stages(sequence_parallel, tp, cp):
    """megatron-core's schedule allocates (seq / CP [/ TP], micro_batch_size, hidden): given the sizes
    ``pipeline_schedule_sizes`` returns, the streams fold into it as a view, and unfold back."""
    from megatron.core.pipeline_parallel.schedules import get_tensor_shapes

    seq, mbs, n, h = 16, 3, 4, 64
    group = lambda size: SimpleNamespace(size=lambda: size)  # noqa: E731  (the schedule asks a group its size)
    config = SimpleNamespace(sequence_parallel=sequence_parallel, hidden_size=h, variable_seq_lengths=False)
    sizes = pipeline_schedule_sizes(seq, mbs, n)
    (shape,) = get_tensor_shapes(**sizes, decoder_seq_length=None, config=config, tp_group=group(tp),
                                 cp_group=group(cp))
    local = seq // cp // (tp if sequence_parallel else 1)
    x = torch.randn(local, mbs, n, h)
    sent = streams_to_stage_output(x)
    assert tuple(sent.shape) == tuple(shape) and sent.data_ptr() == x.data_ptr()
    received = stage_input_to_streams(sent.clone(), n)
    assert torch.equal(received, x)
