"""The resolver of ``compression=`` for Keras: hvdp codecs and Horovod's own compressors
(the core's rule, on the backend's Horovod ``Compression``); the backend's tensors for the
codecs' Horovod ``compress`` / ``decompress`` (``hvd.allreduce(t, compression=...)``)."""
from hvdp.codecs.compressor import register_framework
from hvdp.codecs.resolve import resolve as _resolve

from .backend import BACKEND as B

register_framework(B.tensor_types, B.hvd.Compression)


def resolve(compression):
    """-> (hvdp codec or ``Auto``, Horovod compressor); exactly one is not None."""
    return _resolve(compression, B.hvd.Compression, allow_auto=True)
