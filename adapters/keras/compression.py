"""The resolver of ``compression=`` for Keras: hvdp codecs and Horovod's own compressors
(the same rule as ``hvdp.torch``'s, on horovod.tensorflow's ``Compression``)."""
import horovod.tensorflow as _hvd

from hvdp import codecs


def resolve(compression):
    """-> (hvdp codec, Horovod compressor or None).

    Horovod's own ``Compression.none`` / ``.fp16`` map to hvdp's codecs; any other object with
    Horovod's static ``compress`` / ``decompress`` (a ``horovod.tensorflow.compression.Compressor``
    subclass) keeps Horovod's contract: compress, sum, decompress with the local context. The
    codec is then "none": it plans the (unbucketed) layout the compressor's tensors travel in.
    """
    if compression is _hvd.Compression.none:
        return codecs.get("none"), None
    if compression is _hvd.Compression.fp16:
        return codecs.get("fp16"), None
    if isinstance(compression, (str, codecs.Codec)):
        return codecs.get(compression), None
    if hasattr(compression, "compress") and hasattr(compression, "decompress"):
        return codecs.get("none"), compression
    raise TypeError(f"compression={compression!r}: give a codec name ({', '.join(codecs.names())}), "
                    f"an hvd.Compression member, or a Horovod Compressor")
