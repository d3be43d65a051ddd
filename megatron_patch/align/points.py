"""The names of the points where ``align.capture`` records activations, and what a set of captures holds, read from
its names: torch-free, so that the report, the CLI's argument parsing and ``mpatch``'s start import no torch."""

from __future__ import annotations

from typing import Mapping

Captures = Mapping[str, object]  # point name -> tensor (align.capture's)

SUBLAYER_POINTS = ("attention", "mlp", "output")


RESIDUAL = "residual"


def point_names(num_layers: int, residual: bool = False) -> list[str]:
    """The points in data-flow order; ``residual``: with each layer's residual after its attention step."""
    sublayer = ("attention", RESIDUAL, "mlp", "output") if residual else SUBLAYER_POINTS
    names = ["embedding"]
    for i in range(num_layers):
        names += [f"layers.{i}.{p}" for p in sublayer]
    return names + ["final_norm", "logits"]


def captured_point_names(captures: Captures, num_layers: int) -> list[str]:
    """``point_names`` of what ``captures`` holds: with the residual points where the family's layers have them."""
    return point_names(num_layers, residual=any(n.endswith(f".{RESIDUAL}") for n in captures))


ROUTING = "routing."


SELECTION = "selection."


# The embedding module run on every token id (one id per sequence), [vocab, 1, hidden]: the inputs reach only the
# rows of their own ids, and an untied embedding's other rows would go unseen (two rows swapped was ALIGNED).
EVERY_ID = "embedding.every_id"

# A second forward of an MoE model with every router's choice replaced, on both sides alike, by a fixed one that
# sends the tokens to every expert in turn (``forced_routes``); each MoE layer's MLP output there is the point
# ``layers.{i}.every_expert``. The inputs' own routing leaves experts no token chose unseen (two of them swapped
# was ALIGNED); these outputs compare every expert of every MoE layer, and with no routing flip to allow for.
EVERY_EXPERT = "every_expert"


def every_expert_point(layer: int) -> str:
    return f"layers.{layer}.{EVERY_EXPERT}"


# Each MoE layer's router logits [batch, seq, experts] and, beside them, its score-correction bias (DeepSeek's
# e_score_correction_bias, megatron-core's expert_bias; zeros where the router has none), broadcast to
# [batch, seq, experts]: ``layers.{i}.router``. The routing judged alone lets a router fault through where it moves
# few tokens (fp32 allows 1% of them as near-ties); its logits and bias show any.
ROUTER = "router"


def router_point(layer: int) -> str:
    return f"layers.{layer}.{ROUTER}"


def selection_layers(captures: Captures) -> list[int]:
    """The sparse-attention layers whose key selections ``captures`` holds."""
    return sorted(int(n[len(SELECTION):]) for n in captures if n.startswith(SELECTION))


def routing_layers(captures: Captures) -> list[int]:
    """The MoE layers whose expert choices ``captures`` holds."""
    return sorted(int(n[len(ROUTING):]) for n in captures if n.startswith(ROUTING))


def point_layer(name: str) -> int | None:
    """The decoder layer a point belongs to (None for embedding, final norm and logits)."""
    return int(name.split(".")[1]) if name.startswith("layers.") else None
