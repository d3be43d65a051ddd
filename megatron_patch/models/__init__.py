"""Model families (one folder each, registered from its ``__init__.py``) and what they share, by kind:

- ``description/``: what a model is and which families there are (``Arch``, ``ModelFamily``, the registry, the
  config checks, tiny models);
- ``blocks/``: the pieces families build from and the builder that assembles them on megatron-core;
- ``shape/``: what megatron-core builds for a config (the skeleton, parameter counts, FLOPs);
- ``mapping/``: the weight-mapping vocabulary families write their tables in.

Every other sub-package is a family (``description/registry.py``).
"""
