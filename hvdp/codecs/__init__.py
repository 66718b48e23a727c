"""Gradient codecs, one file each, entered in a registry by name."""
from .base import Codec, get, names, register
from .cast import BF16, FP16, NoCompression
from .int8 import Int8
from .topk import TopK

__all__ = ["Codec", "get", "names", "register", "NoCompression", "FP16", "BF16", "Int8", "TopK"]
