"""What megatron-core builds for a config, known once: the skeleton (every parameter's shape, its torch_dist
chunks and extra state), derived from the weight table without megatron-core where the rules reach
(``derived_skeleton``), else built in a helper process and cached; and from it the parameter counts, each
rank's share and the FLOPs (``model_shape``).
"""
