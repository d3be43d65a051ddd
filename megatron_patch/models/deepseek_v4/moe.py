"""DeepSeek-V4's MoE block, as transformers 5.24's DeepseekV4SparseMoeBlock computes it, on megatron-core's MoELayer
(its token dispatcher, its local experts, expert parallelism):

    out = experts(x, router(x)) + shared_experts(x)

- the router scores every expert with ``scoring_func`` (``sqrtsoftplus``: sqrt(softplus(logit))) of its logit
  ``gate.weight @ x``; it picks the top-k of the scores plus the expert bias (``e_score_correction_bias``,
  megatron-core's ``expert_bias``: it only chooses, and megatron-core moves it by the experts' load); the chosen
  scores, renormalised (always: transformers ignores ``norm_topk_prob``), times ``routed_scaling_factor``, weight
  the experts (``DeepseekV4Router``);
- on a ``hash_moe`` layer the experts are not chosen but looked up, ``tid2eid[token_id]``: a frozen table of k
  experts per vocabulary entry, a buffer (never a parameter, in the checkpoint); the learned gate still weights
  them, renormalised and scaled as above (``DeepseekV4HashRouter``). It has no expert bias;
- routed and shared experts are megatron-core's MLP with V4's clamped SwiGLU: ``silu(min(gate, l)) *
  clamp(up, -l, l)``, ``l = swiglu_limit`` (megatron-core's ``activation_func_clamp_value``, as gpt-oss uses it);
  one shared expert of ``moe_intermediate_size``, as transformers builds it whatever ``n_shared_experts`` says.

Token ids reach a hash layer through ``routing_token_ids``: the model's forward binds the micro-batch's
``input_ids`` [b, s] around the decoder; each hash layer takes its own tokens from them (sequence-first, and this
rank's part of the sequence under sequence parallelism), keeps them through its own activation recompute, and
refuses to run without them. docs/deepseek.md, "DeepSeek-V4: MoE and hash routing", says how the data reaches them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter

from megatron_patch.errors import UserError
from megatron_patch.models.blocks.spec_edits import with_module, with_submodules
from megatron_patch.models.description.arch import require

HASH_MOE, MOE = "hash_moe", "moe"
DEFAULT_HASH_LAYERS = 3  # transformers' DeepseekV4Config.default_num_hash_layers
# transformers' renormalisation: weights / (sum + 1e-20)
RENORM_EPS = 1e-20
# Each as transformers' ACT2FN computes it, in the logits' dtype.
SCORES = {
    "sqrtsoftplus": lambda logits: torch.sqrt(F.softplus(logits)),
    "sigmoid": torch.sigmoid,
    "softmax": lambda logits: torch.softmax(logits, dim=-1),
}


# --- config.json -> the MoE block's settings ---------------------------------------------------------------------

def mlp_layer_types_of(raw: dict) -> tuple[str, ...]:
    """``mlp_layer_types`` as transformers fills it in: given, else the first ``num_hash_layers`` (legacy, 3 when
    absent) ``hash_moe`` and the rest ``moe``."""
    layers = require(raw, "num_hidden_layers")
    types = raw.get("mlp_layer_types")
    if types is None:
        hashed = raw.get("num_hash_layers", DEFAULT_HASH_LAYERS)
        types = [HASH_MOE] * min(layers, hashed) + [MOE] * max(0, layers - hashed)
    if len(types) < layers or set(types) - {HASH_MOE, MOE}:
        raise UserError(f"config.json mlp_layer_types must name {layers} layers, each hash_moe or moe: found {types}")
    return tuple(types[:layers])


def moe_config_kwargs(raw: dict) -> dict:
    """The TransformerConfig settings of V4's MoE block. ``moe_router_score_function`` is nominal ("sigmoid"):
    the family's router computes its own scores (``scoring`` of ``moe_spec``); megatron-core 0.16 allows the
    expert bias, and its update at the end of each step, only with sigmoid scores."""
    if raw.get("hidden_act", "silu") != "silu":
        raise UserError(f"hidden_act={raw['hidden_act']!r} is not supported for DeepSeek-V4: its experts are SwiGLU")
    if raw.get("mlp_bias"):
        raise UserError("mlp_bias=true is not supported for DeepSeek-V4: megatron-core's router has no bias beside "
                        "the expert bias, and transformers' experts have none")
    scoring_of(raw)
    width = require(raw, "moe_intermediate_size", aliases=("intermediate_size",))
    return dict(
        num_moe_experts=require(raw, "n_routed_experts", aliases=("num_local_experts",)),
        moe_router_topk=require(raw, "num_experts_per_tok"), moe_ffn_hidden_size=width,
        moe_shared_expert_intermediate_size=width, moe_grouped_gemm=False,
        gated_linear_unit=True, activation_func=F.silu, glu_linear_offset=0.0,
        activation_func_clamp_value=float(raw.get("swiglu_limit", 10.0)),
        bias_activation_fusion=False,  # megatron-core fuses only the unclamped SwiGLU
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_pre_softmax=False,
        moe_router_topk_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
    )


def scoring_of(raw: dict) -> str:
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORES:
        raise UserError(f"scoring_func={scoring!r} is not supported for DeepSeek-V4: it must be one of "
                        f"{', '.join(SCORES)}")
    return scoring


# --- the routers ------------------------------------------------------------------------------------------------

class DeepseekV4Router(TopKRouter):
    """transformers' DeepseekV4TopKRouter on megatron-core's TopKRouter: ``weight`` is ``gate.weight``,
    ``expert_bias`` is ``gate.e_score_correction_bias``; the scores are ``scoring``'s, not the config's
    ``moe_router_score_function``."""

    def __init__(self, config, *args, scoring: str = "sqrtsoftplus", **kwargs):
        super().__init__(config, *args, **kwargs)
        if scoring not in SCORES:
            raise UserError(f"DeepSeek-V4's router scores with one of {', '.join(SCORES)}, not {scoring!r}")
        self.scoring = scoring
        unsupported = [name for name, on in (
            ("an auxiliary loss", self.is_aux_loss_enabled()), ("sinkhorn routing", self.routing_type == "sinkhorn"),
            ("token dropping", config.moe_expert_capacity_factor is not None),
            ("group-limited routing", config.moe_router_num_groups is not None),
            ("the fused router", config.moe_router_fusion)) if on]
        if unsupported:
            raise UserError(f"DeepSeek-V4's router does not support {unsupported[0]} (it scores with {scoring} "
                            "itself): leave it out")

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """The experts of each token [tokens, k]: the top-k of the scores plus the expert bias."""
        biased = scores if self.expert_bias is None else scores + self.expert_bias
        return torch.topk(biased, self.topk, dim=-1, sorted=False).indices

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        logits = logits.view(-1, self.config.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = self.apply_z_loss(logits, padding_mask=padding_mask)
        scores = SCORES[self.scoring](logits)
        chosen = self.choose(scores)
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
        weights = weights * (self.config.moe_router_topk_scaling_factor or 1.0)
        probs = torch.zeros_like(scores).scatter(1, chosen, weights)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, chosen, True)
        self._apply_expert_bias(routing_map, padding_mask=padding_mask)  # counts the load the bias follows
        return probs, routing_map


class DeepseekV4HashRouter(DeepseekV4Router):
    """transformers' DeepseekV4HashRouter: the experts of a token are ``tid2eid[token_id]`` (a frozen
    [vocab_size, k] int32 buffer: expert numbers fit, and ports of the hub checkpoint hold it so), weighted by the
    learned gate; no expert bias. ``token_ids`` (sequence-first, flattened as the router flattens its tokens) is
    bound by ``DeepseekV4MoELayer`` for the length of its forward."""

    def __init__(self, config, *args, vocab_size: int, **kwargs):
        super().__init__(config, *args, **kwargs)
        # no expert bias on a hash layer: without the attribute megatron-core's end-of-step update skips it
        self.enable_expert_bias = False
        del self.expert_bias, self.local_tokens_per_expert
        # a model trained from scratch draws its table as the hub's are, k distinct experts per token (megatron's
        # seeded generator); zeros would send every token to expert 0 k times, which megatron-core's routing map
        # cannot hold (0.19 fails splitting the tokens). A checkpoint's table replaces it.
        order = torch.rand(vocab_size, self.config.num_moe_experts, device=self.weight.device).argsort(dim=1)
        self.register_buffer("tid2eid", order[:, :self.topk].to(torch.int32).contiguous(), persistent=True)
        self.token_ids: torch.Tensor | None = None
        self._table_checked: tuple | None = None  # the table ``check_table`` last passed: (id, version)

    def check_table(self) -> None:
        """The table a checkpoint gave (untrusted input): each row k distinct experts of the layer's. An expert
        number outside them was an internal error in the first step, and a row naming one twice trained silently
        another model than transformers' (docs/deepseek.md: not representable); both are refused in one line (the
        dsa audit). Checked once per table, at its first use, by the MoE layer (outside a compiled router)."""
        table = self.tid2eid
        seen = (id(table), table._version)  # a load copies into the buffer in place, which bumps its version
        if self._table_checked == seen:
            return
        experts = self.config.num_moe_experts
        where = f"layer {self.layer_number - 1}'s tid2eid" if self.layer_number else "a hash layer's tid2eid"
        low, high = int(table.min()), int(table.max())
        if low < 0 or high >= experts:
            raise UserError(f"{where} names expert {low if low < 0 else high}, and the layer has {experts} (0 to "
                            f"{experts - 1}): the checkpoint is damaged or not this model's")
        ordered = table.sort(dim=1).values
        repeated = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
        if bool(repeated.any()):
            token = int(repeated.nonzero()[0])
            raise UserError(f"{where} names one expert twice for token {token} ({table[token].tolist()}): "
                            "megatron-core routes a token to each expert once, "
                            "so this model cannot be trained or evaluated as transformers computes it "
                            "(docs/deepseek.md)")
        self._table_checked = seen

    def _maintain_float32_expert_bias(self):
        pass  # it has no expert bias

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        if self.token_ids is None:
            raise RuntimeError("a hash_moe router ran without token ids: run it inside DeepseekV4MoELayer, under "
                               "routing_token_ids(input_ids)")
        if self.token_ids.numel() != scores.shape[0]:
            raise RuntimeError(f"a hash_moe router has {scores.shape[0]} tokens but {self.token_ids.numel()} token ids")
        return self.tid2eid[self.token_ids.reshape(-1)].long()


# --- token ids for hash routing ---------------------------------------------------------------------------------

_BOUND_TOKEN_IDS: list[torch.Tensor | None] = [None]


@contextlib.contextmanager
def routing_token_ids(input_ids: torch.Tensor | None):
    """Binds this micro-batch's token ids for the hash layers of a forward: ``input_ids`` [b, s] as the model
    takes them (after context-parallel slicing, as the data gives every stage its batch). Unbound on exit, so a
    layer run outside it (or recomputed after it, but for its own recompute and the block's full recompute:
    layers.py) fails instead of routing by another micro-batch's tokens."""
    previous, _BOUND_TOKEN_IDS[0] = _BOUND_TOKEN_IDS[0], input_ids
    try:
        yield
    finally:
        _BOUND_TOKEN_IDS[0] = previous


def bound_token_ids() -> torch.Tensor | None:
    """The token ids ``routing_token_ids`` bound (None outside it)."""
    return _BOUND_TOKEN_IDS[0]


class DeepseekV4MoELayer(MoELayer):
    """megatron-core's MoELayer that hands a hash router its tokens' ids: this rank's [s, b] tokens of the bound
    ``input_ids``. Its own activation recompute (``recompute_modules`` "moe") keeps the ids with the input."""

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        if not isinstance(self.router, DeepseekV4HashRouter):
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        # checked here, eagerly: the router may be compiled (MP_COMPILE), and the check's data-dependent branch
        # would keep dynamo from tracing it
        self.router.check_table()
        token_ids = self.local_token_ids(hidden_states)
        if self.moe_layer_recompute and torch.is_grad_enabled() and intermediate_tensors is None:
            return tensor_parallel.checkpoint(self._hash_forward, False, hidden_states, token_ids, padding_mask)
        return self._hash_forward(hidden_states, token_ids, padding_mask, intermediate_tensors)

    def _hash_forward(self, hidden_states, token_ids, padding_mask, intermediate_tensors=None):
        recompute, self.moe_layer_recompute = self.moe_layer_recompute, False  # recomputed here, with the ids
        self.router.token_ids = token_ids
        try:
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        finally:
            self.moe_layer_recompute, self.router.token_ids = recompute, None

    def local_token_ids(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The bound ids of this rank's tokens, [s, b] as ``hidden_states`` [s, b, h]: under sequence
        parallelism this TP rank's contiguous part of the sequence."""
        ids = _BOUND_TOKEN_IDS[0]
        if ids is None:
            raise RuntimeError(f"MoE layer {self.layer_number} routes by token id (hash_moe) but no token ids are "
                               "bound: run the model's forward inside moe.routing_token_ids(input_ids)")
        ids = ids.t()
        s, b = hidden_states.shape[:2]
        if self.config.sequence_parallel and ids.shape[0] == s * self.tp_group.size() != s:
            rank = self.tp_group.rank()
            ids = ids[rank * s:(rank + 1) * s]
        if tuple(ids.shape) != (s, b):
            raise RuntimeError(f"MoE layer {self.layer_number} has {s} x {b} tokens (sequence x batch) but the bound "
                               f"token ids are {tuple(ids.t().shape)} (batch x sequence)")
        return ids.to(hidden_states.device)


def moe_spec(mlp_layer_type: str, scoring: str, vocab_size: int):
    """The spec of one layer's MoE block (a layer's ``mlp``): local experts, a shared expert, V4's router, hash
    routing on a ``hash_moe`` layer."""
    moe = get_gpt_layer_local_spec(num_experts=2, moe_grouped_gemm=False, normalization="RMSNorm").submodules.mlp
    router = (functools.partial(DeepseekV4HashRouter, scoring=scoring, vocab_size=vocab_size)
              if mlp_layer_type == HASH_MOE else functools.partial(DeepseekV4Router, scoring=scoring))
    return with_module(with_submodules(moe, router=router), DeepseekV4MoELayer)


# --- names -------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MoEWeight:
    """One tensor of the MoE block under three names, each relative to the block: megatron-core's (under the
    layer's ``mlp.``), transformers' module's (under ``model.layers.{i}.mlp.``; ``name[e]`` is expert e of a
    stacked tensor) and the hub's on disk (under ``layers.{i}.ffn.``). Several names are concatenated on dim 0."""
    mcore: str
    transformers: tuple[str, ...]
    hub: tuple[str, ...]


def weight_names(mlp_layer_type: str, num_experts: int) -> list[MoEWeight]:
    """Every tensor of one layer's MoE block, experts by their global index (megatron-core numbers an EP rank's
    local experts from 0). [gate; up] is megatron-core's ``linear_fc1`` as it is transformers' ``gate_up_proj``
    (the hub's w1 then w3, transformers' conversion_mapping)."""
    names = [MoEWeight("router.weight", ("gate.weight",), ("gate.weight",))]
    if mlp_layer_type == HASH_MOE:
        names.append(MoEWeight("router.tid2eid", ("gate.tid2eid",), ("gate.tid2eid",)))
    else:
        names.append(MoEWeight("router.expert_bias", ("gate.e_score_correction_bias",), ("gate.bias",)))
    for e in range(num_experts):
        names += [
            MoEWeight(f"experts.local_experts.{e}.linear_fc1.weight", (f"experts.gate_up_proj[{e}]",),
                      (f"experts.{e}.w1.weight", f"experts.{e}.w3.weight")),
            MoEWeight(f"experts.local_experts.{e}.linear_fc2.weight", (f"experts.down_proj[{e}]",),
                      (f"experts.{e}.w2.weight",)),
        ]
    shared = "shared_experts"
    return names + [
        MoEWeight(f"{shared}.linear_fc1.weight", (f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"),
                  (f"{shared}.w1.weight", f"{shared}.w3.weight")),
        MoEWeight(f"{shared}.linear_fc2.weight", (f"{shared}.down_proj.weight",), (f"{shared}.w2.weight",)),
    ]


def transformers_tensor(state: dict[str, torch.Tensor], weight: MoEWeight) -> torch.Tensor:
    """``weight``'s tensor from a transformers DeepseekV4SparseMoeBlock's state dict."""
    parts = []
    for name in weight.transformers:
        stacked, _, index = name.partition("[")
        parts.append(state[stacked][int(index[:-1])] if index else state[name])
    return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
