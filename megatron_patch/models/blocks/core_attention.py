"""Which core attention a model on megatron-core's local layer spec runs (the transformer-engine spec brings
its own): megatron-core's unfused ``DotProductAttention`` or torch SDPA (``models/blocks/sdpa_attention.py``).

- On a GPU without transformer-engine the default is SDPA: torch's flash / memory-efficient / cuDNN kernels,
  where the unfused one keeps a [b, heads, s, s] fp32 score matrix per layer.
- On CPU the default stays megatron's unfused attention, the arithmetic the fp32 parity floor and the
  memory plan's measurements were taken with; ``FL=true`` (or ``core_attention="sdpa"``) selects SDPA.

Layers with a sliding window or attention sinks run megatron's arithmetic inside the SDPA class
(``sdpa_attention.fallback_reason``).
"""

from __future__ import annotations

from megatron_patch.errors import UserError

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).
# So are blocks.sdpa_attention and blocks.local_attention, which import megatron-core at
# their top.

UNFUSED = "unfused"
SDPA = "sdpa"
CHOICES = (UNFUSED, SDPA)

DESCRIPTIONS = {
    UNFUSED: "local: megatron-core DotProductAttention (unfused softmax)",
    SDPA: "sdpa: torch scaled_dot_product_attention on megatron-core's local spec",
}


def default_core_attention(cuda: bool | None = None) -> str:
    """SDPA where CUDA is (``cuda`` None: this machine), megatron's unfused attention on CPU."""
    if cuda is None:
        import torch  # the launcher and the converter start without torch

        cuda = torch.cuda.is_available()
    return SDPA if cuda else UNFUSED


def resolve(name: str | None) -> str:
    if name is None:
        return default_core_attention()
    if name not in CHOICES:
        raise UserError(f"core attention '{name}' is not one of {', '.join(CHOICES)}")
    return name


def describe(name: str | None) -> str:
    """One line for logs, dry runs and reports."""
    return DESCRIPTIONS[resolve(name)]


def core_attention_class(name: str | None, mla: bool) -> type:
    """The class a local layer spec builds for ``name`` (None: this machine's default)."""
    if resolve(name) == SDPA:
        from megatron_patch.models.blocks.sdpa_attention import SDPAttention

        return SDPAttention
    if mla:
        from megatron_patch.models.blocks.local_attention import LocalMLACoreAttention

        return LocalMLACoreAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


def core_attention_of(model) -> str | None:
    """What ``model``'s core attention modules are: "sdpa", "unfused", or None for transformer-engine's."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_patch.models.blocks.sdpa_attention import SDPAttention

    kinds = set()
    for module in model.modules():
        inner = getattr(module, "core_attention", None)
        if isinstance(inner, SDPAttention):
            kinds.add(SDPA)
        elif isinstance(inner, DotProductAttention) or getattr(inner, "requires_dsa_inputs", False):
            kinds.add(UNFUSED)  # DeepSeek sparse attention's arithmetic is the unfused one's, masked to its keys
    if len(kinds) > 1:
        raise RuntimeError(f"a model with mixed core attentions: {sorted(kinds)}")
    return kinds.pop() if kinds else None
