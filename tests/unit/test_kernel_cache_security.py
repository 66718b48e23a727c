"""The kernel cache loads nothing another account could have planted (issue 26, item 1).

Each planted library is a real shared object whose constructor writes a marker file: had hvdp
loaded it, the marker would exist. The directories under test are this test's own: the user's
cache (``XDG_CACHE_HOME``) and the system's tmp (``tempfile.tempdir``) both point into tmp_path.
The parts that plant a file owned by another uid need root (``os.chown``) and are skipped
otherwise; the mode and symlink parts run as any user.
"""
import os
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest

from hvdp import codecs
from hvdp.kernels import build, cpu, registry
from hvdp.kernels.base import Unavailable
from hvdp.ops import NumpyOps
from hvdp.private import Refused, private_dir, refusal

OPS = NumpyOps()
OTHER_UID = 12345
try:
    CC, CC_VERSION = build.find_compiler()
except Unavailable:
    CC = None
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler: no kernel library to build or plant")
needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="planting a file owned by another uid needs root (os.chown)")
LIB = "libcpu_codecs.so"


@pytest.fixture
def places(tmp_path, monkeypatch):
    """(cache anchor, tmp anchor) of this test alone; build's memo cleared before and after."""
    cache, tmp = tmp_path / "cache", tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)  # like /tmp: anyone may create entries
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.delenv("CC", raising=False)
    # -O0: what is loaded from where does not depend on the optimisation, and the library is
    # built in about 0.4 s instead of 3.4 s (-O3) in each test (its results are still checked)
    monkeypatch.setattr(build, "BASE_FLAGS", ("-O0",) + tuple(f for f in build.BASE_FLAGS if not f.startswith("-O")))
    build._build.cache_clear()
    yield cache, tmp
    build._build.cache_clear()


def keys():
    with open(cpu._SRC, "rb") as f:
        source = f.read()
    return [build.cache_key(source, CC, CC_VERSION, flags)
            for flags in (build.BASE_FLAGS + build.ARCH_FLAGS, build.BASE_FLAGS)]


def plant(directory, marker):
    """A shared library at ``directory/libcpu_codecs.so`` whose constructor writes ``marker``."""
    os.makedirs(directory, exist_ok=True)
    c = os.path.join(os.path.dirname(marker), "evil.c")
    with open(c, "w") as f:
        f.write('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) '
                f'{{ FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("ran", f); fclose(f); }} }}\n')
    so = os.path.join(directory, LIB)
    subprocess.run([CC, "-shared", "-fPIC", "-o", so, c], check=True, capture_output=True)
    return so


def plant_everywhere(anchor_dirs, marker):
    return [plant(os.path.join(d, key), marker) for d in anchor_dirs for key in keys()]


def select_int8(marker=None):
    """The kernels hvdp picks for int8 now, checked against the reference, and the warnings;
    first of all, the planted constructor did not run."""
    codec = codecs.get("int8", block_size=128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        k, why = registry.explain(codec, OPS, np.zeros(4, np.float32))
    assert marker is None or not os.path.exists(marker), f"the planted library was loaded: {why}"
    assert k is not None and k.path == "cpu-c", why
    x = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    np.testing.assert_array_equal(k.encode(x), codec.encode(OPS, x))  # results unchanged
    return k, [str(w.message) for w in caught if "hvdp kernels" in str(w.message)]


def loaded_path():
    return build.build(cpu._SRC)[0]


def under(path, directory):
    """Whether ``path`` is ``directory`` or lies under it, compared as paths: as strings,
    ``<tmp>/hvdp-kernels-038xp1mx/...`` starts with ``<tmp>/hvdp-kernels-0`` (issue 39)."""
    path, directory = Path(path), Path(directory)
    return path == directory or directory in path.parents


# --- hvdp.private on its own ------------------------------------------------------------------
def test_private_dir_creates_0700_and_checks_what_exists(tmp_path):
    d = private_dir(str(tmp_path / "anchor"), "a", "b")
    for p in (tmp_path / "anchor" / "a", tmp_path / "anchor" / "a" / "b"):
        assert stat.S_IMODE(os.lstat(p).st_mode) == 0o700, oct(os.lstat(p).st_mode)
    assert private_dir(str(tmp_path / "anchor"), "a", "b") == d  # found again and accepted
    (tmp_path / "anchor" / "a").chmod(0o755)  # e.g. made by mkdir -p: not writable by others
    assert private_dir(str(tmp_path / "anchor"), "a", "b") == d
    (tmp_path / "anchor" / "a").chmod(0o775)
    with pytest.raises(Refused, match=r"/a is writable by group \(mode 0775\)"):
        private_dir(str(tmp_path / "anchor"), "a", "b")
    (tmp_path / "f").write_text("")
    assert refusal(str(tmp_path / "f"), "dir") == "is not a directory"
    assert refusal(str(tmp_path / "f"), "file") is None
    os.chmod(tmp_path / "f", 0o666)
    assert refusal(str(tmp_path / "f"), "file") == "is writable by group and others (mode 0666)"
    os.symlink(tmp_path / "f", tmp_path / "link")
    assert refusal(str(tmp_path / "link"), "file").startswith("is a symbolic link")
    assert refusal(str(tmp_path / "missing")).startswith("cannot be examined")


# --- the cache in use -------------------------------------------------------------------------
@needs_cc
def test_normal_private_cache_is_made_0700_and_used_again(places):
    cache, tmp = places
    k, warned = select_int8()
    assert warned == []
    path = loaded_path()
    assert path == os.path.join(str(cache), "hvdp", "kernels", keys()[0], LIB)
    for p in (cache / "hvdp", cache / "hvdp" / "kernels", os.path.dirname(path)):
        st = os.lstat(p)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid(), (p, oct(st.st_mode))
    st = os.lstat(path)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert os.listdir(os.path.dirname(path)) == [LIB]  # the temporary build name is gone
    mtime = st.st_mtime_ns
    build._build.cache_clear()  # as a new process would: the cached file is found, not rebuilt
    assert loaded_path() == path and os.lstat(path).st_mtime_ns == mtime
    assert os.listdir(tmp) == []  # nothing in tmp


@needs_cc
def test_library_is_built_under_a_temporary_name_then_renamed(places, tmp_path, monkeypatch):
    """A compiler that writes half a file and fails leaves nothing at the library's name; one that
    succeeds writes a private temporary name in the same directory, renamed into place."""
    log = tmp_path / "cc.log"
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec {CC} --version\n'
                       f'echo "$@" >> {log}\n'
                       f'if [ -e {tmp_path}/fail ]; then\n'
                       '  while [ "$1" != -o ]; do shift; done; echo partial > "$2"; echo "cc: broken" >&2; exit 1\n'
                       f'fi\nexec {CC} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    (tmp_path / "fail").write_text("")
    with pytest.raises(Unavailable, match=r"failed \(cc: broken\)"):
        loaded_path()
    libs = [f for _, _, fs in os.walk(places[0]) for f in fs]
    assert libs == [], libs
    (tmp_path / "fail").unlink()
    build._build.cache_clear()
    path = loaded_path()
    out = log.read_text().splitlines()[-1].split()
    written = out[out.index("-o") + 1]
    assert written != path and os.path.dirname(written) == os.path.dirname(path)
    assert os.path.basename(written).startswith(".build-") and not os.path.exists(written)


# --- planted libraries are never loaded -------------------------------------------------------
@needs_cc
@needs_root
@pytest.mark.parametrize("mode", [0o777, 0o755])
def test_tmp_fallback_owned_by_another_uid_is_not_loaded(places, tmp_path, mode):
    """The issue's case: the user's cache cannot be made (XDG_CACHE_HOME names a file), and
    another account made tmp's hvdp-kernels-<uid>/<key>/libcpu_codecs.so first."""
    cache, tmp = places
    cache.write_text("not a directory")
    marker = str(tmp_path / "constructor-ran")
    shared = tmp / f"hvdp-kernels-{os.geteuid()}"
    for so in plant_everywhere([str(shared)], marker):
        for p in (shared, os.path.dirname(so), so):
            os.chown(p, OTHER_UID, OTHER_UID)
            os.chmod(p, mode)
    k, warned = select_int8(marker)
    assert warned and all(f"not loading from {shared}: it is owned by uid {OTHER_UID}" in w for w in warned), warned
    fresh = Path(loaded_path()).parent
    assert fresh.parent == tmp and fresh != shared and not under(fresh, shared), fresh
    assert fresh.name.startswith("hvdp-kernels-tmp-"), fresh  # a fresh mkdtemp
    assert stat.S_IMODE(os.lstat(fresh).st_mode) == 0o700
    assert f"refused: {shared} is owned by uid {OTHER_UID}" in k.description  # doctor shows it
    assert not os.path.exists(marker)


@needs_cc
@needs_root
def test_library_owned_by_another_uid_in_own_directory_is_not_loaded(places, tmp_path):
    cache, _ = places
    marker = str(tmp_path / "constructor-ran")
    d = private_dir(str(cache), "hvdp", "kernels")
    for so in plant_everywhere([d], marker):
        os.chown(so, OTHER_UID, OTHER_UID)
        os.chmod(so, 0o755)
    k, warned = select_int8(marker)
    assert any(f"{LIB}: it is owned by uid {OTHER_UID}" in w for w in warned), warned
    assert not under(loaded_path(), d)


@needs_cc
def test_other_writable_tmp_directory_is_not_loaded(places, tmp_path):
    """The same planting as a directory of this user's but left 0777: runs as any user."""
    cache, tmp = places
    cache.write_text("not a directory")
    marker = str(tmp_path / "constructor-ran")
    shared = tmp / f"hvdp-kernels-{os.geteuid()}"
    for so in plant_everywhere([str(shared)], marker):
        for p in (shared, os.path.dirname(so)):
            os.chmod(p, 0o777)
    k, warned = select_int8(marker)
    assert any(f"not loading from {shared}: it is writable by group and others (mode 0777)" in w
               for w in warned), warned
    assert not under(loaded_path(), shared)


@needs_cc
def test_group_writable_library_is_not_loaded(places, tmp_path):
    cache, tmp = places
    marker = str(tmp_path / "constructor-ran")
    d = private_dir(str(cache), "hvdp", "kernels")
    for so in plant_everywhere([d], marker):
        os.chmod(os.path.dirname(so), 0o700)
        os.chmod(so, 0o775)
    k, warned = select_int8(marker)
    assert any(f"{LIB}: it is writable by group (mode 0775)" in w for w in warned), warned
    path = loaded_path()
    assert not under(path, d), path
    assert under(path, tmp / f"hvdp-kernels-{os.geteuid()}"), path  # tmp's checked per-user directory


@needs_cc
@pytest.mark.parametrize("which", ["hvdp", "kernels", "key"])
def test_symlinked_cache_directory_is_not_followed(places, tmp_path, which):
    """One component of the cache is a symbolic link to a directory that is private in every other
    way (this user's, 0700) and holds a library: the link is refused, the library not loaded."""
    cache, tmp = places
    marker = str(tmp_path / "constructor-ran")
    kernels = cache / "hvdp" / "kernels"
    elsewheres = []
    for i, key in enumerate(keys()):
        elsewhere = tmp_path / f"elsewhere{i}"
        elsewheres.append(elsewhere)
        link, planted = {"hvdp": (cache / "hvdp", elsewhere / "kernels" / key),
                         "kernels": (kernels, elsewhere / key),
                         "key": (kernels / key, elsewhere)}[which]
        plant(str(planted), marker)
        for p in [planted, *planted.parents]:
            if p == tmp_path:
                break
            p.chmod(0o700)
        link.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if which == "key" or i == 0:
            link.symlink_to(elsewhere)
    k, warned = select_int8(marker)
    assert any(f"not loading from {cache}" in w and "it is a symbolic link" in w for w in warned), warned
    real = os.path.realpath(loaded_path())
    assert not any(under(real, e) for e in elsewheres), real


@needs_cc
def test_nothing_private_left_falls_back_to_array_ops_with_the_reason(places, tmp_path, monkeypatch):
    cache, tmp = places
    cache.write_text("not a directory")
    shared = tmp / f"hvdp-kernels-{os.geteuid()}"
    shared.mkdir()
    shared.chmod(0o777)

    def no_mkdtemp(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", no_mkdtemp)
    with pytest.warns(RuntimeWarning, match="not loading from"):
        k, why = registry.explain(codecs.get("bf16"), OPS, np.zeros(4, np.float32))
    assert k is None
    assert any(w.startswith("cpu-c: no private directory to build libcpu_codecs.so in (")
               and f"{shared} is writable by group and others (mode 0777)" in w for w in why), why
