"""Compile a kernel's C source once with the system C compiler and cache the shared library.

The library lands in ``~/.cache/hvdp/kernels/<key>/`` (``$XDG_CACHE_HOME`` respected;
``$HVDP_CACHE_DIR/kernels/<key>/`` where ``HVDP_CACHE_DIR`` is set), the key
being a hash of the source, the compiler (path and version), the flags and, since the code is
compiled for this CPU (``-march=native``), the CPU's model and flags: a home directory shared by
different machines gets one library per kind of CPU. Each process compiles to its own temporary
name and renames it into place, so ranks that start together never load a half-written file.
No ``-ffast-math``: the kernels must give the reference's bits.

A library is loaded only from a directory only this user can have written (``hvdp.private``):
each directory hvdp creates is 0700, each one it finds is checked (owner, no group/other write,
no symbolic link), and so is the library itself. Where the cache cannot be made, a per-user
directory in tmp is used under the same checks; where a directory or library is refused (another
account could have planted it), a warning names it and why, and the library is compiled afresh
in a private ``tempfile.mkdtemp`` directory removed at exit.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from functools import lru_cache
from typing import Iterator, List, Tuple

from ..config import cache_dir
from ..private import Refused, private_dir, refusal
from .base import Unavailable

BASE_FLAGS = ("-O3", "-std=c99", "-fno-strict-aliasing", "-ffp-contract=off", "-fPIC", "-shared")
ARCH_FLAGS = ("-march=native",)


def _cache_base() -> Tuple[str, Tuple[str, ...]]:
    """(anchor, hvdp's directories under it) of the kernel cache: ``$HVDP_CACHE_DIR/kernels``
    where that is set (it moves every cache of hvdp's), else ``~/.cache/hvdp/kernels``
    (``$XDG_CACHE_HOME`` respected)."""
    moved = cache_dir()
    if moved:
        return moved, ("kernels",)
    return (os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
            ("hvdp", "kernels"))


def cache_root() -> str:
    anchor, parts = _cache_base()
    return os.path.join(anchor, *parts)


def places(key: str) -> List[Tuple[str, Tuple[str, ...]]]:
    """Where the library of ``key`` may live, in order: (anchor, the directories hvdp controls
    under it). The user's cache, then a per-user directory in tmp."""
    anchor, parts = _cache_base()
    return [(anchor, parts + (key,)),
            (tempfile.gettempdir(), (f"hvdp-kernels-{os.geteuid()}", key))]


def find_compiler() -> Tuple[str, str]:
    """(path, first line of ``--version``) of ``$CC``, else gcc / cc / clang on PATH."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        path = shutil.which(cc)
        if path is None:
            raise Unavailable(f"no C compiler: CC={cc!r} is not an executable (point CC at gcc or unset it)")
    else:
        path = next((p for p in map(shutil.which, ("gcc", "cc", "clang")) if p), None)
        if path is None:
            raise Unavailable("no C compiler: install gcc (e.g. apt-get install gcc) or set CC")
    try:
        r = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable(f"no C compiler: {path} --version failed ({e}); install gcc or set CC") from None
    first = (r.stdout or r.stderr).strip().splitlines()
    return path, first[0] if first else "unknown version"


def _cpu_id() -> str:
    ident = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    ident.append(line.strip())
                if len(ident) > 4:
                    break
    except OSError:
        pass
    return "\n".join(ident)


def cache_key(source: bytes, cc: str, version: str, flags) -> str:
    """The directory name of one library: source, compiler, version, flags and CPU."""
    return hashlib.sha256(b"\0".join([source, os.path.realpath(cc).encode(), version.encode(),
                                      " ".join(flags).encode(), _cpu_id().encode()])).hexdigest()[:20]


def _compile(cc: str, flags, src: str, target: str) -> str:
    """Compile to a private temporary name in the target's (checked) directory, make it 0700,
    then rename it into place: returns "" or the compiler's error. OSError: no temporary file."""
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    try:
        r = subprocess.run([cc, *flags, "-o", tmp, src, "-lm"], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            out = (r.stderr or r.stdout).strip()
            return out.splitlines()[-1] if out else f"exit {r.returncode}"
        os.chmod(tmp, 0o700)  # the linker recreates the file with the umask's mode
        os.replace(tmp, target)
        return ""
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _refuse(path: str, why: str, refused: List[str]) -> None:
    if f"{path} {why}" in refused:  # met again with the next flags
        return
    refused.append(f"{path} {why}")
    warnings.warn(f"hvdp kernels: not loading from {path}: it {why}; another account could have put a "
                  "library there, so hvdp compiles its own in a private directory instead (remove or "
                  "fix that path, or set XDG_CACHE_HOME to a directory of your own)", RuntimeWarning,
                  stacklevel=3)


def _directories(key: str, notes: List[str], refused: List[str]) -> Iterator[str]:
    """The checked directories a library of ``key`` may be loaded from or built in, in order;
    last a fresh ``mkdtemp`` directory of this process (removed at exit)."""
    for anchor, parts in places(key):
        try:
            d = private_dir(anchor, *parts)
        except Refused as e:
            _refuse(e.path, e.why, refused)
            continue
        except OSError as e:  # an unwritable or full cache, XDG_CACHE_HOME naming a file
            notes.append(f"{os.path.join(anchor, *parts)}: {e.strerror or e}")
            continue
        yield d
    try:
        d = tempfile.mkdtemp(prefix="hvdp-kernels-tmp-")  # never read as hvdp-kernels-<uid>
    except OSError as e:
        notes.append(f"a private directory in {tempfile.gettempdir()}: {e.strerror or e}")
        return
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    yield d


@lru_cache(maxsize=None)
def _build(src: str, cc_env: str) -> Tuple[str, str]:
    cc, version = find_compiler()
    with open(src, "rb") as f:
        source = f.read()
    lib = f"lib{os.path.splitext(os.path.basename(src))[0]}.so"
    errors, notes, refused = [], [], []
    for flags in (BASE_FLAGS + ARCH_FLAGS, BASE_FLAGS):  # without -march when the compiler refuses it
        for d in _directories(cache_key(source, cc, version, flags), notes, refused):
            target = os.path.join(d, lib)
            if os.path.lexists(target):
                why = refusal(target, "file")
                if why is None:
                    return target, _describe(version, flags, refused)
                _refuse(target, why, refused)
                continue
            try:
                err = _compile(cc, flags, src, target)
            except OSError as e:  # no room for the temporary file: try the next place
                notes.append(f"{d}: {e.strerror or e}")
                continue
            if not err:
                return target, _describe(version, flags, refused)
            errors.append(err)
            break
    if errors:
        raise Unavailable(f"compiling {os.path.basename(src)} with {cc} failed ({errors[-1]}); "
                          "install a working gcc or set CC")
    raise Unavailable(f"no private directory to build {lib} in ({'; '.join(refused + notes)}); "
                      "set XDG_CACHE_HOME or TMPDIR to a directory of your own")


def _describe(version: str, flags, refused=()) -> str:
    words = version.split()
    short = f"{os.path.basename(words[0])} {words[-1]}" if words else "cc"
    desc = f"{short}, {' '.join(f for f in flags if f.startswith(('-O', '-march')))}"
    return desc + (f"; refused: {'; '.join(refused)}" if refused else "")


def build(src: str) -> Tuple[str, str]:
    """(path of the shared library, description such as "gcc 12.2.0, -O3 -march=native") of the
    C file ``src``; raises :class:`Unavailable` naming the fix when no library can be made.
    The path is in a directory only this user can have written (see the module's text)."""
    return _build(src, os.environ.get("CC", ""))
