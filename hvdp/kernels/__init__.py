"""Fused codec kernels behind the codec contract (``base.CodecKernels``) and their selection
(``registry``: ``select``, ``explain``, ``register``). The CPU backend (``cpu``) registers itself
when selection first runs; the torch adapter registers its CUDA kernels on import."""
from .base import CodecKernels, Unavailable
from .registry import explain, register, select

__all__ = ["CodecKernels", "Unavailable", "explain", "register", "select"]
