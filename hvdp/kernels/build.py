"""Compile a kernel's C source once with the system C compiler and cache the shared library.

The library lands in ``~/.cache/hvdp/kernels/<key>/`` (``$XDG_CACHE_HOME`` respected), the key
being a hash of the source, the compiler (path and version), the flags and, since the code is
compiled for this CPU (``-march=native``), the CPU's model and flags: a home directory shared by
different machines gets one library per kind of CPU. Each process compiles to its own temporary
name and renames it into place, so ranks that start together never load a half-written file.
No ``-ffast-math``: the kernels must give the reference's bits.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from typing import Tuple

from .base import Unavailable

BASE_FLAGS = ("-O3", "-std=c99", "-fno-strict-aliasing", "-ffp-contract=off", "-fPIC", "-shared")
ARCH_FLAGS = ("-march=native",)


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hvdp", "kernels")


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


def _compile(cc: str, flags, src: str, target: str) -> str:
    """Compile to a private temporary name, then rename: returns "" or the compiler's error."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    try:
        r = subprocess.run([cc, *flags, "-o", tmp, src, "-lm"], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            return (r.stderr or r.stdout).strip().splitlines()[-1:][0] if (r.stderr or r.stdout).strip() \
                else f"exit {r.returncode}"
        os.replace(tmp, target)
        return ""
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@lru_cache(maxsize=None)
def _build(src: str, cc_env: str) -> Tuple[str, str]:
    cc, version = find_compiler()
    with open(src, "rb") as f:
        source = f.read()
    errors = []
    for flags in (BASE_FLAGS + ARCH_FLAGS, BASE_FLAGS):  # without -march when the compiler refuses it
        key = hashlib.sha256(b"\0".join([source, os.path.realpath(cc).encode(), version.encode(),
                                         " ".join(flags).encode(), _cpu_id().encode()])).hexdigest()[:20]
        name = os.path.splitext(os.path.basename(src))[0]
        for root in (cache_root(), os.path.join(tempfile.gettempdir(), f"hvdp-kernels-{os.getuid()}")):
            target = os.path.join(root, key, f"lib{name}.so")
            if os.path.exists(target):
                return target, _describe(version, flags)
            try:
                err = _compile(cc, flags, src, target)
            except OSError as e:  # an unwritable cache: try the next place
                errors.append(str(e))
                continue
            if not err:
                return target, _describe(version, flags)
            errors.append(err)
            break
    raise Unavailable(f"compiling {os.path.basename(src)} with {cc} failed ({errors[-1] if errors else '?'}); "
                      "install a working gcc or set CC")


def _describe(version: str, flags) -> str:
    words = version.split()
    short = f"{os.path.basename(words[0])} {words[-1]}" if words else "cc"
    return f"{short}, {' '.join(f for f in flags if f.startswith(('-O', '-march')))}"


def build(src: str) -> Tuple[str, str]:
    """(path of the shared library, description such as "gcc 12.2.0, -O3 -march=native") of the
    C file ``src``; raises :class:`Unavailable` naming the fix when no library can be made."""
    return _build(src, os.environ.get("CC", ""))
