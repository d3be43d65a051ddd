"""The pieces families build their models from, and the builder that puts them together on megatron-core:
config fields and weight-table pieces that Llama-style decoders share (``decoder``) and DeepSeek-V3's hub layout
of MTP layers (``mtp``); RoPE from config.json; the local spec's core attentions (megatron-core's, SDPA, MLA's,
DeepSeek sparse attention) and compiled fusions; spec edits; ``builder`` (Arch + layout -> GPTModel) and
``inference`` (its full-vocabulary logits).
"""
