"""The codec contract and the registry every codec enters by name."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Dict, Type

from .compressor import horovod_compressor

Array = Any


class Codec:
    """Turns a flat float32 chunk into a byte payload and back.

    A payload's size depends only on the chunk length (``payload_nbytes``), so payloads of equal
    chunks can travel in one alltoall / allgather. ``summable`` codecs (a plain dtype cast) keep
    Horovod's contract: their cast survives a sum-allreduce and they use Horovod's allreduce.
    The others go through hvdp's two-phase reduction (see ``hvdp.reduce.twophase``).
    """

    name: ClassVar[str] = ""
    summable: ClassVar[bool] = False
    wire_dtype: ClassVar[str] = "uint8"       # dtype handed to allreduce when summable
    error_feedback_default: ClassVar[bool] = False

    @property
    def warmup_steps(self) -> int:
        """Optimizer steps reduced uncompressed (plain float32 allreduce) before this codec starts;
        added to the policy's ``warmup_steps`` (the larger one counts)."""
        return 0

    @property
    def align(self) -> int:
        """Chunk lengths are padded to a multiple of this."""
        return 1

    def payload_nbytes(self, n: int) -> int:
        raise NotImplementedError

    def encode(self, ops, x: Array) -> Array:
        """float32 chunk of length n (a multiple of ``align``) -> uint8 payload."""
        raise NotImplementedError

    def decode(self, ops, payload: Array, n: int) -> Array:
        """uint8 payload -> float32 chunk of length n."""
        raise NotImplementedError

    # Horovod's Compressor contract, for Horovod's own collectives (hvd.allreduce(t, compression=
    # hvd.Compression.fp16)): the framework's Horovod compressor of the same name does the work
    def compress(self, tensor: Array) -> tuple:
        """Horovod's ``compress``: ``(compressed tensor, context)`` (summable codecs only)."""
        return horovod_compressor(self, tensor).compress(tensor)

    def decompress(self, tensor: Array, ctx: Any) -> Array:
        """Horovod's ``decompress``: the tensor back in the dtype ``ctx`` names."""
        return horovod_compressor(self, tensor).decompress(tensor, ctx)

    def configure(self, **settings) -> "Codec":
        """A copy with other settings, e.g. ``Compression.topk.configure(ratio=0.05)``."""
        return dataclasses.replace(self, **settings)

    def __str__(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)) \
            if dataclasses.is_dataclass(self) else ""
        return f"{self.name}({fields})" if fields else self.name


_REGISTRY: Dict[str, Type[Codec]] = {}


def register(cls: Type[Codec]) -> Type[Codec]:
    """Class decorator: enter a codec under ``cls.name``; a duplicate name is an error."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY:
        raise ValueError(f"codec {cls.name!r} is already registered by {_REGISTRY[cls.name].__name__}")
    _REGISTRY[cls.name] = cls
    return cls


def names() -> list:
    return sorted(_REGISTRY)


def get(spec: "str | Codec", **settings) -> Codec:
    """A codec from its name (``"int8"``) or an instance; ``settings`` override its defaults.

    Example::

        get("int8", block_size=128)
    """
    if isinstance(spec, Codec):
        return spec.configure(**settings) if settings else spec
    if not isinstance(spec, str):
        raise TypeError(f"compression must be a codec name or a Codec, not {type(spec).__name__}; "
                        f"valid names: {', '.join(names())}")
    key = spec.strip().lower()
    if key not in _REGISTRY:
        raise ValueError(f"unknown compression {spec!r}; valid names: {', '.join(names())}")
    try:
        return _REGISTRY[key](**settings)
    except TypeError as e:
        fields = [f.name for f in dataclasses.fields(_REGISTRY[key])]
        raise ValueError(f"bad settings for codec {key!r}: {e}; it takes {fields or 'none'}") from None
