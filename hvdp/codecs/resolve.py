"""``compression=`` as both adapters take it: an hvdp codec (a name or object) or a Horovod
compressor. The adapter passes its framework's ``horovod.<fw>.Compression`` in."""
from typing import Any, Optional, Tuple

from .auto import Auto
from .base import Codec, get, names


def resolve(compression: Any, horovod_compression: Any,
            allow_auto: bool = False) -> Tuple[Optional[Codec], Any]:
    """-> (hvdp codec, Horovod compressor); exactly one of them is not None.

    ``"auto"`` / ``Compression.auto`` gives an :class:`~hvdp.codecs.auto.Auto` (the chooser's
    settings) where the adapter supports it (``allow_auto``), and a clear error elsewhere.

    Horovod's own ``Compression.none`` / ``.fp16`` map to hvdp's codecs of those names; any other
    object with Horovod's static ``compress`` / ``decompress`` (a user's ``Compressor`` subclass)
    keeps Horovod's contract: compress, sum, decompress with the local context.

    Example::

        codec, compressor = resolve("int8", horovod.torch.Compression)
    """
    if compression is horovod_compression.none:
        return get("none"), None
    if compression is horovod_compression.fp16:
        return get("fp16"), None
    if isinstance(compression, str) and compression.strip().lower() == "auto":
        compression = Auto()
    if isinstance(compression, Auto):
        if not allow_auto:
            raise ValueError("compression='auto' is not supported by this adapter yet; give a codec "
                             f"name ({', '.join(names())}) or an hvd.Compression member")
        return compression, None
    if isinstance(compression, (str, Codec)):
        return get(compression), None
    if hasattr(compression, "compress") and hasattr(compression, "decompress"):
        return None, compression
    raise TypeError(f"compression={compression!r}: give a codec name ({', '.join(names())}) or "
                    "'auto', an hvd.Compression member, or a Horovod Compressor")
