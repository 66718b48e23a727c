"""The torch adapter's fused codec kernels, registered with ``hvdp.kernels`` on import.

CUDA tensors: the int8 and int4 codecs' Triton kernels (``kernels_cuda``), asked before the CPU backend.
Triton is imported only when a CUDA tensor first asks, so a CPU build of torch (which has no
Triton) never imports it; CPU tensors are served by the core's C kernels through zero-copy views.
"""
import torch

from hvdp.kernels.base import Unavailable
from hvdp.kernels.registry import register

_cache = {}


def cuda_provider(codec, ops, like):
    """int8 / int4 on a CUDA tensor -> the Triton kernels; anything else -> Unavailable (why)."""
    if not (isinstance(like, torch.Tensor) and like.is_cuda):
        raise Unavailable("serves CUDA tensors only")
    if getattr(codec, "name", None) not in ("int8", "int4"):
        raise Unavailable(f"no CUDA kernel for {codec}: the casts are one torch op already")
    if codec not in _cache:
        try:
            from .kernels_cuda import KERNELS
        except ImportError as e:
            raise Unavailable(f"Triton is not importable ({e}); it ships with CUDA builds of torch: "
                              "pip install triton") from None
        _cache[codec] = KERNELS[codec.name](codec)
    return _cache[codec]


register("cuda-triton", cuda_provider, first=True)
