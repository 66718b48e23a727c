"""Checkpoint files that cannot tear: write a temporary file, fsync it, rename, fsync the folder.

A process killed at any point leaves either the previous checkpoint or the new one, whole.
"""
from __future__ import annotations

import os
import tempfile
from typing import Callable, IO


def _fsync_dir(folder: str) -> None:
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)  # the rename itself reaches the disk
    finally:
        os.close(dfd)


def atomic_save(path: str, save: Callable[[str], None]) -> None:
    """For writers that take a file name: ``save(tmp)`` beside ``path`` (same suffix), then
    fsync and rename over ``path``.

    Example::

        atomic_save("model.keras", model.save)
    """
    folder, base = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".tmp-{os.getpid()}-{base}")  # keeps the suffix writers check
    try:
        save(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)


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
    _fsync_dir(folder)
