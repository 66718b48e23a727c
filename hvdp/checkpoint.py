"""Checkpoint files that cannot tear: write a temporary file, fsync it, rename, fsync the folder.

A process killed at any point leaves either the previous checkpoint or the new one, whole.
"""
from __future__ import annotations

import os
import tempfile
from typing import Callable, IO


def atomic_write(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write(f)`` on a temporary file beside ``path``, then atomically replace ``path``.

    Example::

        atomic_write("ckpt.pt", lambda f: torch.save(state, f))
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)  # the rename itself reaches the disk
    finally:
        os.close(dfd)
