"""Directories and files that only this user can have written: the only places hvdp loads from.

A path hvdp controls is trusted when ``lstat`` shows it is not a symbolic link, is of the
expected kind, is owned by the effective user and is writable by neither group nor others (the
rule OpenSSH applies to key files; ``tempfile.mkdtemp`` and pip's cache make 0700 directories).
Directories hvdp creates are made with mode 0700. A directory inside a trusted one can only be
created or replaced by its owner (or root), so checking each component from the first one hvdp
controls down to the file leaves no window for another account.

Example::

    d = private_dir(os.path.expanduser("~/.cache"), "hvdp", "kernels", key)  # or Refused
    why = refusal(os.path.join(d, "libcpu_codecs.so"), "file")                 # None: trusted
"""
from __future__ import annotations

import os
import stat
from typing import Optional


class Refused(Exception):
    """A path hvdp will not trust; ``path`` names it and ``why`` says what is wrong with it."""

    def __init__(self, path: str, why: str):
        super().__init__(f"{path} {why}")
        self.path, self.why = path, why


def refusal(path: str, kind: str = "dir") -> Optional[str]:
    """Why ``path`` cannot be trusted, or None when it can.

    Args:
        path: the directory or file, examined with ``lstat`` (a symbolic link is not followed).
        kind: ``"dir"`` or ``"file"`` (a regular file).
    """
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot be examined ({e.strerror or e})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link (hvdp follows none inside the directories it controls)"
    if kind == "dir" and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if kind == "file" and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    uid = os.geteuid()
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = " and ".join(w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH))
                           if st.st_mode & bit)
        return f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def private_dir(anchor: str, *parts: str) -> str:
    """``anchor/parts...``, each part created with mode 0700 where missing and checked where present.

    ``anchor`` (the user's cache directory, the system's tmp) is the user's or the system's, not
    hvdp's: it is created if missing but not checked. Raises :class:`Refused` naming the first
    part that cannot be trusted, or ``OSError`` when a part cannot be created.
    """
    os.makedirs(anchor, exist_ok=True)
    path = anchor
    for part in parts:
        path = os.path.join(path, part)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        why = refusal(path, "dir")
        if why is not None:
            raise Refused(path, why)
    return path
