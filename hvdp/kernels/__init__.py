"""Fused codec kernels behind the codec contract (see ``base.CodecKernels``) and their selection."""
from .base import CodecKernels

__all__ = ["CodecKernels"]
