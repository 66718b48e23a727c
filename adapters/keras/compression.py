"""The resolver of ``compression=`` for Keras: hvdp codecs and Horovod's own compressors
(the core's rule, on the backend's Horovod ``Compression``)."""
from hvdp.codecs.resolve import resolve as _resolve

from .backend import BACKEND as B


def resolve(compression):
    """-> (hvdp codec or ``Auto``, Horovod compressor); exactly one is not None."""
    return _resolve(compression, B.hvd.Compression, allow_auto=True)
