"""megatron_patch: Llama-3.1, Qwen2 and MoE training on Megatron-Core, from Hugging Face and back."""

__version__ = "0.1.0"
