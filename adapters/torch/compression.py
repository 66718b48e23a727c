"""The resolver of ``compression=``: hvdp codecs and Horovod's own compressors."""
import horovod.torch as _hvd

from hvdp import codecs
from hvdp.codecs import Compression  # noqa: F401  (re-exported as hvd.Compression)


def resolve(compression):
    """-> (hvdp codec or None, Horovod compressor or None).

    Horovod's own ``Compression.none`` / ``.fp16`` map to hvdp's codecs; any other object with
    Horovod's static ``compress`` / ``decompress`` keeps Horovod's contract (compress, sum, decompress).
    """
    if compression is _hvd.Compression.none:
        return codecs.get("none"), None
    if compression is _hvd.Compression.fp16:
        return codecs.get("fp16"), None
    if isinstance(compression, (str, codecs.Codec)):
        return codecs.get(compression), None
    if hasattr(compression, "compress") and hasattr(compression, "decompress"):
        return None, compression
    raise TypeError(f"compression={compression!r}: give a codec name ({', '.join(codecs.names())}), "
                    f"an hvd.Compression member, or a Horovod Compressor")
