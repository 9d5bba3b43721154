"""MHA Lab: multi-head attention from intuition to GPU kernel.

``mha_lab.cpu`` is the NumPy reference; ``mha_lab.cuda`` (PyTorch, Triton) is imported only
when asked for, so ``import mha_lab`` needs nothing but NumPy.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
