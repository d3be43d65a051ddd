"""Model families (one folder each, see ``family.py``) and what they share: Arch, the builder, RoPE,
the weight-mapping vocabulary (``mapping/``), tiny models. ``registry`` lists the families.
"""
