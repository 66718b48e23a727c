"""The resolver of ``compression=`` for Keras: hvdp codecs and Horovod's own compressors
(the core's rule, on the backend's Horovod ``Compression``)."""
from hvdp import codecs
from hvdp.codecs.resolve import resolve as _resolve

from .backend import BACKEND as B


def resolve(compression):
    """-> (hvdp codec, Horovod compressor or None). With a Horovod compressor the codec is
    "none": it plans the (unbucketed) layout the compressor's tensors travel in."""
    codec, compressor = _resolve(compression, B.hvd.Compression, allow_auto=True)  # auto: autochoice.py
    return codec or codecs.get("none"), compressor
