"""The resolver of ``compression=`` for Keras: hvdp codecs and Horovod's own compressors
(the core's rule, on horovod.tensorflow's ``Compression``)."""
import horovod.tensorflow as _hvd

from hvdp import codecs
from hvdp.codecs.resolve import resolve as _resolve


def resolve(compression):
    """-> (hvdp codec, Horovod compressor or None). With a Horovod compressor the codec is
    "none": it plans the (unbucketed) layout the compressor's tensors travel in."""
    codec, compressor = _resolve(compression, _hvd.Compression)
    return codec or codecs.get("none"), compressor
