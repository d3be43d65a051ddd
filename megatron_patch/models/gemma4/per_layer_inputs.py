"""Gemma 4's per-layer input embeddings (E2B, E4B: ``hidden_size_per_layer_input`` P), as transformers 5.24
computes them.

On the first pipeline stage, ``PerLayerInputs`` (``per_layer_inputs.``, a model-level module the family's
``finish_model`` adds) turns the token ids and the embedding's (scaled) output into every layer's input,
[s, b, L x P]: the token ids' rows of ``embed_tokens`` (vocab-parallel like the main embedding, times sqrt(P) in its
dtype), plus the embedding's output through ``model_projection`` (H -> L x P, times H**-0.5) and
``projection_norm`` over each layer's P, the sum times 2**-0.5. They reach the layers as the decoder block's
``context``, which megatron-core hands to every layer and through activation recomputation (a tensor argument, not
a side channel). Each layer (``PerLayerInput``, ``decoder.layers.N.per_layer_input.``), after its MLP's residual
add: ``gate`` (H -> P), tanh-GELU, times its own P-slice, ``projection`` (P -> H), ``norm``, added to the residual.

Tensor parallelism: only the big embedding is split (by vocabulary); the projections and norms are replicated on
every TP rank (2 x H x P per layer beside the MLP's 3 x H x F: a split would cost two collectives per layer for a
few per cent of its weights). Under sequence parallelism the embedding's rows are reduce-scattered as the main
embedding's are, and the replicated weights' gradients summed over the TP group (``sequence_parallel``).
Pipeline parallelism is refused (``Gemma4Settings.check_layout``): the later stages would need the inputs sent.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
from megatron.core.transformer.module import MegatronModule

from megatron_patch.models.blocks.sandwich_norms import ReplicatedOverTP, gelu_tanh
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.gemma4.settings import settings


def _device(config):
    return "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()


class ReplicatedLinear(ReplicatedOverTP, torch.nn.Linear):
    """A linear layer without bias that every TP rank holds whole."""

    def __init__(self, config, tp_group, in_size: int, out_size: int, init_method):
        super().__init__(in_size, out_size, bias=False, dtype=config.params_dtype, device=_device(config))
        self.tp_group = tp_group
        if config.perform_initialization:
            init_method(self.weight)
        if config.sequence_parallel:  # each rank saw its share of the sequence: finalize_model_grads sums them
            self.weight.sequence_parallel = True


def _replicated_norm(norm: type, config, size: int, tp_group):
    module = norm(config, size, eps=config.layernorm_epsilon)
    module.tp_group = tp_group
    return module


class PerLayerInputs(MegatronModule):
    """Every layer's per-layer input, [s, b, L x P], from the token ids and the embedding's output."""

    def __init__(self, config, arch: Arch, norm: type, tp_group):
        super().__init__(config)
        own = settings(arch)
        self.size, self.layers = own.per_layer_input_size, own.per_layer_input_layers
        width = self.layers * self.size
        self.embed_tokens = VocabParallelEmbedding(
            arch.padded_vocab_size(), width, init_method=config.init_method,
            reduce_scatter_embeddings=config.sequence_parallel, config=config, tp_group=tp_group)
        self.model_projection = ReplicatedLinear(config, tp_group, config.hidden_size, width, config.init_method)
        self.projection_norm = _replicated_norm(norm, config, self.size, tp_group)
        self.pending: torch.Tensor | None = None  # from the embedding's forward to the decoder's, in one forward

    def forward(self, input_ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        tokens = self.embed_tokens(input_ids)  # [b, s, L*P]; under sequence parallelism [s/tp, b, L*P]
        if not self.config.sequence_parallel:
            tokens = tokens.transpose(0, 1).contiguous()
        tokens = tokens * torch.tensor(self.size ** 0.5, dtype=tokens.dtype, device=tokens.device)
        projected = self.model_projection(embedded) * self.config.hidden_size ** -0.5
        projected = self.projection_norm(projected.view(*projected.shape[:-1], self.layers, self.size))
        return ((projected + tokens.view_as(projected)) * 2.0 ** -0.5).flatten(-2)

    def after_embedding(self, module, args, kwargs, output):
        """A forward hook on the model's embedding: this forward's per-layer inputs, for the decoder."""
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        self.pending = self(input_ids, output)

    def before_decoder(self, module, args, kwargs):
        """A forward pre-hook on the decoder block: the per-layer inputs as its ``context``."""
        if self.pending is None:
            raise RuntimeError("gemma4's per-layer inputs need the token ids: the model was run without its "
                               "embedding (decoder_input given)")
        kwargs["context"], self.pending = self.pending, None
        return args, kwargs


class PerLayerInput(MegatronModule):
    """A layer's use of its per-layer input: after the MLP's residual add, ``gate``, tanh-GELU, times the input,
    ``projection``, ``norm``, added to the residual."""

    def __init__(self, config, size: int, norm: type, tp_group):
        super().__init__(config)
        self.size = size
        self.gate = ReplicatedLinear(config, tp_group, config.hidden_size, size, config.init_method)
        self.projection = ReplicatedLinear(config, tp_group, size, config.hidden_size, config.output_layer_init_method)
        self.norm = _replicated_norm(norm, config, config.hidden_size, tp_group)

    def forward(self, hidden: torch.Tensor, inputs: torch.Tensor | None, layer: int) -> torch.Tensor:
        if inputs is None:
            raise RuntimeError("gemma4's layers need their per-layer inputs (the decoder block's context): none came")
        mine = inputs[..., layer * self.size:(layer + 1) * self.size]
        return hidden + self.norm(self.projection(gelu_tanh(self.gate(hidden)) * mine))


def install(model, arch: Arch, norm: type) -> None:
    """On the first stage, the per-layer inputs' module and the hooks that carry them to the decoder."""
    if not getattr(model, "pre_process", False):
        return
    tp_group = model.embedding.word_embeddings.tp_group if hasattr(model.embedding.word_embeddings, "tp_group") \
        else None
    model.per_layer_inputs = PerLayerInputs(model.config, arch, norm, tp_group)
    model.embedding.register_forward_hook(model.per_layer_inputs.after_embedding, with_kwargs=True)
    model.decoder.register_forward_pre_hook(model.per_layer_inputs.before_decoder, with_kwargs=True)
