"""LoRA on Megatron-Core, one adapter per Hugging Face module, exact against peft both ways.

- ``spec``: what was asked (MP_LORA_* or a peft adapter_config.json), validated in one line;
- ``plan``: which MCore linear layers take adapters, and the adapters' shapes and names, from the
  family's weight table (``Rule.lora``) and the model's shape; torch-free but for shapes;
- ``peft_io``: adapters to and from peft's folder format (adapter_config.json, adapter_model.safetensors);
- ``layers``: the live adapters on a rank's model chunks (TP / SP / EP / ETP sharding), frozen base;
- ``state``: the adapters' checkpoint entries (torch_dist keys that do not depend on the layout) and
  the record of the base model (path and digest);
- ``merge``: the HF weights with the adapters merged in (fp32, then cast), one tensor at a time.

docs/lora.md says what each part does and why.
"""
