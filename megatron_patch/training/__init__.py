"""Training on megatron.core: launcher arguments, data, the loop, checkpoints, preprocessing."""
