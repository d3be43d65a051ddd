"""Gemma 4's own settings, typed: what only its modules read (kept in ``Arch.family_config``). A module of its own,
so that the config reader, the layers and the weight table all read it without importing each other."""

import dataclasses

from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import Arch, FamilyConfig, pipeline_layer_ranges


@dataclasses.dataclass(frozen=True)
class Gemma4Settings(FamilyConfig):
    """What only Gemma 4's own modules read: the full-attention layers' proportional RoPE (the sliding-window
    layers' default RoPE is ``Arch.rope_theta``), the final logits' soft cap, and whether the full-attention
    layers' key projection doubles as their values."""

    full_rope_theta: float
    full_partial_rotary_factor: float  # the share of each head's pairs that rotates; the rest pass through
    full_rope_factor: float
    final_logit_softcapping: float | None
    # attention_k_eq_v: the full-attention layers have no v_proj; their values are the key projection's output
    # before k_norm and RoPE (v_norm still applies), as transformers' Gemma4TextAttention takes them
    full_keys_are_values: bool = False
    # per-layer input embeddings (hidden_size_per_layer_input; 0: none): each layer's input of this width, and the
    # layers the per-layer embedding packs (config.json's num_hidden_layers, kept when a shape probe builds fewer)
    per_layer_input_size: int = 0
    per_layer_input_layers: int = 0
    # KV sharing, each layer's part as transformers' kv_sharing_modes says it: None, "store" (the last layer of its
    # attention type before the shared ones: its keys and values serve them) or "reuse" (no key/value weights)
    kv_sharing: tuple[str | None, ...] = ()
    double_wide_mlp: bool = False  # use_double_wide_mlp: the "reuse" layers' MLP is twice intermediate_size

    def reuses_kv(self, layer: int) -> bool:
        return bool(self.kv_sharing) and self.kv_sharing[layer] == "reuse"

    def layer_kind(self, layer: int) -> str:
        return "kv-shared" if self.reuses_kv(layer) else ""

    def only_layers(self, layers: tuple[int, ...]) -> "Gemma4Settings":
        if not self.kv_sharing:
            return self
        return dataclasses.replace(self, kv_sharing=tuple(self.kv_sharing[i] for i in layers))

    def check_layout(self, arch: Arch, layout, pp_first_stage_layers: int | None) -> None:
        if self.per_layer_input_size and layout.pp > 1:
            raise UserError(f"PP={layout.pp}: gemma4's per-layer input embeddings (hidden_size_per_layer_input) are "
                            "computed on the first stage and not sent to the others yet: set PP=1")
        if not self.kv_sharing or layout.pp == 1:
            return
        if layout.vp is not None:
            raise UserError(f"VP={layout.vp}: gemma4's KV-shared layers run only without a virtual pipeline")
        stage = {layer: k for k, layers in enumerate(pipeline_layer_ranges(arch.num_layers, layout.pp,
                                                                            pp_first_stage_layers))
                 for layer in layers}
        for layer, mode in enumerate(self.kv_sharing):
            store = self.store_of(arch, layer) if mode == "reuse" else None
            if store is not None and stage[store] != stage[layer]:
                raise UserError(f"PP={layout.pp}: gemma4's layer {layer} reuses the keys and values of layer {store}, "
                                "which is on another pipeline stage: choose a layout that keeps them on one stage")

    def store_of(self, arch: Arch, layer: int) -> int:
        """The layer whose keys and values ``layer`` (a "reuse" layer) takes: the "store" layer of its type."""
        return next(i for i, mode in enumerate(self.kv_sharing)
                    if mode == "store" and arch.layer_types[i] == arch.layer_types[layer])


def settings(arch: Arch) -> Gemma4Settings:
    return arch.family_config


KV_SHARING_FULL_RECOMPUTE = ("gemma4's KV-shared layers (num_kv_shared_layers) take an earlier layer's keys and "
                             "values from its forward, which full activation recomputation does not re-run for them: "
                             "use AC=sel or AC=none")


def recompute_refused(arch, mode: str, megatron_core: tuple[int, ...]) -> str | None:
    return KV_SHARING_FULL_RECOMPUTE if mode == "full" and "reuse" in arch.family_config.kv_sharing else None
