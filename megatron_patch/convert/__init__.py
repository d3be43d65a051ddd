"""The converter: ``mpatch convert`` between HF folders and MCore checkpoints, planned whole and then run as
byte moves (``checkpoint``, ``bytemap``, ``copier``), with the dequantizing readers of hub checkpoints (``fp8``,
``mxfp4``) and LoRA adapters through it (``lora_io``). What a checkpoint is and how weights reach a live model
is ``megatron_patch.checkpoint``'s.
"""
