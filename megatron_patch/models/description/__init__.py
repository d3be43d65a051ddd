"""What a model is, and which families there are: ``Arch`` (a config.json read once), ``ModelFamily`` and the
registry of the family folders, the checks of every config value, Megatron-LM's saved arguments read as a
config, the transformers model of an HF folder, and the tiny random checkpoints. No megatron-core here.
"""
