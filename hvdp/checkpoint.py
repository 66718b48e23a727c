"""Checkpoint files that cannot tear: write a temporary file, fsync it, rename, fsync the folder.

A process killed at any point leaves either the previous checkpoint or the new one, whole. A
write that fails (a full or read-only disk) removes its temporary file, leaves the previous
checkpoint as it was and raises :class:`CheckpointWriteError` naming the path and the cause;
:func:`rank0_writes` makes every rank of a job raise that same error.
"""
from __future__ import annotations

import errno as _errno
import os
import tempfile
from typing import Any, Callable, IO, Optional

from .cluster.flight import RECORDER as FLIGHT


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the file at ``filename`` (if any) is the previous one,
    unchanged. ``errno`` / ``strerror`` are the cause's (``errno.ENOSPC``, ``errno.EROFS``, ...;
    None when the cause was not an OS error). Raised alike on every rank of a collective save."""

    def __init__(self, message: str, errno: Optional[int] = None, strerror: Optional[str] = None,
                 filename: Optional[str] = None):
        super().__init__(errno, strerror, filename)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return type(self), (self.message, self.errno, self.strerror, self.filename)

    def fields(self) -> dict:
        return {"message": self.message, "errno": self.errno, "strerror": self.strerror,
                "filename": self.filename}


def _size(name: str) -> Optional[int]:
    try:
        return os.stat(name).st_size
    except OSError:
        return None


def _failed(path: str, tmp: str, err: OSError, handed: Optional[int] = None) -> CheckpointWriteError:
    """``err`` (raised while writing ``tmp`` for ``path``) as a CheckpointWriteError that says
    where, why and how far the write got (call before the temporary file is removed)."""
    code = err.errno
    why = err.strerror or str(err)
    name = _errno.errorcode.get(code, "") if code is not None else ""
    parts = []
    if handed is not None:
        parts.append(f"{handed:,} bytes handed to the file")
    got = _size(tmp)
    if got is not None:
        parts.append(f"{got:,} bytes reached the temporary file")
    try:
        if code not in (_errno.ENOSPC, _errno.EDQUOT):
            raise OSError  # free space is beside the point
        fs = os.statvfs(os.path.dirname(os.path.abspath(path)))
        parts.append(f"{fs.f_bavail * fs.f_frsize:,} of {fs.f_blocks * fs.f_frsize:,} bytes free on its filesystem")
    except OSError:
        pass
    other = err.filename and os.path.abspath(str(err.filename)) != os.path.abspath(path)
    where = f" (at '{err.filename}')" if other else ""
    msg = (f"could not write the checkpoint '{path}': {why}{f' ({name})' if name else ''}{where}"
           f"{': ' + ', '.join(parts) if parts else ''}. The file at that path, if any, is the previous "
           f"checkpoint, unchanged; no temporary file is left.")
    return CheckpointWriteError(msg, code, why, path)


def _os_error(e: BaseException) -> Optional[OSError]:
    """``e`` or the OS error behind it (writers such as torch.save and h5py report a refused
    write as an error of their own, raised while handling it)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _remove(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except OSError:  # never there, or the disk refuses even that: the error that matters is raised
        pass


def rank0_writes(write: Callable[[], Any], rank: int, broadcast_object: Callable[..., Any], path: str,
                 what: str = "hvd.save_checkpoint", name: str = "hvdp.ckpt.done") -> None:
    """Collective: rank 0 runs ``write()``; then every rank learns how it went (one
    ``broadcast_object``) and, where it failed, every rank raises the same
    :class:`CheckpointWriteError` (rank 0's chained to the original), so no rank goes on
    believing it saved and none waits for a rank that gave up.

    Example::

        rank0_writes(lambda: atomic_save(path, model.save), hvd.rank(), hvd.broadcast_object, path)
    """
    failure, cause = None, None
    if rank == 0:
        try:
            write()
        except CheckpointWriteError as e:
            failure, cause = e.fields(), e
        except Exception as e:  # not the disk: still every rank's error, not rank 0's alone
            failure = {"message": f"could not write the checkpoint '{path}': {type(e).__name__}: {e}",
                       "errno": getattr(e, "errno", None), "strerror": getattr(e, "strerror", None),
                       "filename": path}
            cause = e
    with FLIGHT.around(name, "broadcast_object"):  # where a rank killed while writing leaves the others
        failure = broadcast_object(failure, root_rank=0, name=name)
    if failure is not None:
        failure = dict(failure, message=f"{what}: rank 0 {failure['message']} No rank has saved.")
        raise CheckpointWriteError(**failure) from cause


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
    tmp = os.path.join(folder, f".tmp-{os.getpid()}-{base}")  # keeps the suffix writers check
    try:
        os.makedirs(folder, exist_ok=True)
        save(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except Exception as e:
        cause = _os_error(e)
        if cause is None:
            _remove(tmp)
            raise
        err = _failed(path, tmp, cause)
        _remove(tmp)
        raise err from e
    except BaseException:
        _remove(tmp)
        raise
    _fsync_dir(folder)


def atomic_write(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write(f)`` on a temporary file beside ``path``, then atomically replace ``path``.

    Example::

        atomic_write("ckpt.pt", lambda f: torch.save(state, f))
    """
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    except OSError as e:  # e.g. a read-only disk: nothing was created
        raise _failed(path, os.path.join(folder, "(none)"), e) from e
    counted = _Counted()
    try:
        with os.fdopen(fd, "wb") as f:
            counted.f = f
            write(counted)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:
        cause = _os_error(e)  # torch.save reports a full disk as its zip writer's RuntimeError
        if cause is None:
            _remove(tmp)
            raise
        err = _failed(path, tmp, cause, counted.handed)
        _remove(tmp)
        raise err from e
    except BaseException:
        _remove(tmp)
        raise
    _fsync_dir(folder)


class _Counted:
    """The temporary file, counting the bytes handed to it (what the writer tried to write)."""

    def __init__(self):
        self.f, self.handed = None, 0

    def write(self, b) -> int:
        self.handed += memoryview(b).nbytes
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)
