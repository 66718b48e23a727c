"""Gradient codecs, one file each, entered in a registry by name."""
from .auto import Auto
from .base import Codec, get, names, register
from .cast import BF16, FP16, NoCompression
from .int4 import Int4
from .int8 import Int8
from .powersgd import PowerSGD
from .topk import TopK

__all__ = ["Auto", "Codec", "Compression", "get", "names", "register", "NoCompression", "FP16", "BF16", "Int4",
           "Int8", "PowerSGD", "TopK"]


class Compression:
    """Codec objects by name, the ``hvd.Compression`` of both adapters:
    ``Compression.int8``, ``Compression.topk.configure(ratio=0.05)``,
    ``Compression.powersgd.configure(rank=4)``; ``Compression.auto``
    lets hvdp choose per bucket (``hvdp.reduce.auto``)."""

    none = get("none")
    fp16 = get("fp16")
    bf16 = get("bf16")
    int8 = get("int8")
    int4 = get("int4")
    topk = get("topk")
    powersgd = get("powersgd")
    auto = Auto()
