"""The resolver of ``compression=``: hvdp codecs and Horovod's own compressors."""
import horovod.torch as _hvd

from hvdp.codecs import Compression  # noqa: F401  (re-exported as hvd.Compression)
from hvdp.codecs.resolve import resolve as _resolve


def resolve(compression):
    """-> (hvdp codec, ``Auto`` settings or None; Horovod compressor or None); see
    :func:`hvdp.codecs.resolve.resolve`."""
    return _resolve(compression, _hvd.Compression, allow_auto=True)
