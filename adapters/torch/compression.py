"""The resolver of ``compression=``: hvdp codecs and Horovod's own compressors; torch tensors for
the codecs' Horovod ``compress`` / ``decompress`` (``hvd.allreduce(t, compression=...)``)."""
import horovod.torch as _hvd
import torch

from hvdp.codecs import Compression  # noqa: F401  (re-exported as hvd.Compression)
from hvdp.codecs.compressor import register_framework
from hvdp.codecs.resolve import resolve as _resolve

register_framework((torch.Tensor,), _hvd.Compression)


def resolve(compression):
    """-> (hvdp codec, ``Auto`` settings or None; Horovod compressor or None); see
    :func:`hvdp.codecs.resolve.resolve`."""
    return _resolve(compression, _hvd.Compression, allow_auto=True)
