"""A small byte-level language model the course trains itself, so that claims about trained models are measured.

``transformer``: the decoder (MHA Lab's own attention layer, RoPE, grouped K/V heads, an optional
learned sink logit); ``corpus``: the text it reads, from a pinned package's source; ``train``: the
committed training command (``python -m mha_lab train``) and the stored weights. PyTorch is needed.
"""
