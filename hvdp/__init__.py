"""hvdp: data-parallel training with Horovod, with gradient compression that stays correct.

The core (this package) is framework-agnostic: it imports numpy at most. The framework
adapters are ``hvdp.torch`` and ``hvdp.keras``.
"""
__version__ = "0.1.0"
