"""hvdp: data-parallel training with Horovod, with gradient compression that stays correct.

The core (this package) is framework-agnostic: it imports numpy at most. The framework
adapters are ``hvdp.torch`` and ``hvdp.keras``.
"""
# The policy the adapters' messages and docstrings name as ``hvdp.CompressionPolicy`` (the same
# class as ``hvdp.torch.CompressionPolicy`` and ``hvdp.keras.CompressionPolicy``).
from .reduce.plan import CompressionPolicy

__version__ = "0.1.0"
__all__ = ["CompressionPolicy", "__version__"]
