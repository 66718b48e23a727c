"""Helpers for tests that run real ``horovodrun -np 2 -H localhost:2`` jobs."""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(ROOT, "tests", "parallel", "workers")
CONTROLLERS = ["gloo", "mpi"]


def horovodrun(args, np=2, controller="gloo", timeout=240, env=None, launcher=()):
    """Run ``horovodrun`` (``launcher``: more of its own options) and return (returncode,
    combined output); a hang fails at ``timeout``."""
    exe = shutil.which("horovodrun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    if exe is None:
        pytest.skip("horovodrun not found: run `make setup`")
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
                    **(env or {}))
    full_env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + full_env["PATH"]
    cmd = [exe, "-np", str(np), "-H", f"localhost:{np}", f"--{controller}", *launcher, sys.executable] + list(args)
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"horovodrun timed out after {timeout}s (a hang):\n{out[-3000:]}")
    log_job(args, np, controller, time.monotonic() - t0, r.returncode)
    return r.returncode, r.stdout + r.stderr


def log_job(args, np, controller, seconds, rc):
    """HVDP_TEST_JOBLOG=<file>: one JSON line per horovodrun job (the test, the worker and its
    arguments, the seconds it took), to see where the suite's time goes."""
    path = os.environ.get("HVDP_TEST_JOBLOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "np": np,
                                "controller": controller, "args": [str(a).replace(ROOT + "/", "") for a in args],
                                "seconds": round(seconds, 2), "rc": rc}) + "\n")


def first_error(output, lines=60):
    """The first rank's traceback in a horovodrun output (its ``[r]<stderr>:`` lines from the
    first ``Traceback``, at most ``lines``), or "" where no rank printed one: a failed job's
    cause, which the output's tail may have cut off behind the other ranks' shutdown messages."""
    m = re.search(r"^\[(\d+)\]<stderr>:Traceback", output, re.M)
    if m is None:
        return ""
    tag = f"[{m.group(1)}]<stderr>:"
    mine = [ln for ln in output[m.start():].splitlines() if ln.startswith(tag)]
    return "\n".join(mine[:lines])


def checks_passed(output):
    """Names of the checks every rank reported as passed ('CHECK <name> OK rank=<r>')."""
    seen = {}
    for name, rank in re.findall(r"CHECK (\S+) OK rank=(\d+)", output):
        seen.setdefault(name, set()).add(rank)
    return seen


def scratch_disks():
    """Mount a full-able and a read-only disk for the checkpoint checks: -> (a context manager
    yielding the workers' environment and unmounting on leaving, None) or (None, why they cannot
    be mounted here). HVDP_TEST_DISK_FULL: a 256 KiB tmpfs; HVDP_TEST_DISK_RO: a read-only bind
    mount of HVDP_TEST_DISK_RO_SRC (root ignores chmod, so a mount it is)."""
    import contextlib
    import tempfile
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None, "mounting a small tmpfs and a read-only bind mount needs root"
    base = tempfile.mkdtemp(prefix="hvdp-disk-")
    full, src, ro = (os.path.join(base, d) for d in ("full", "src", "ro"))
    for d in (full, src, ro):
        os.mkdir(d)

    def unmount():
        for d in (ro, full):  # (os.path.ismount cannot see a bind mount of the same filesystem)
            subprocess.run(["umount", d], capture_output=True, timeout=30)
        shutil.rmtree(base, ignore_errors=True)

    for cmd in (["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", full], ["mount", "--bind", src, ro],
                ["mount", "-o", "remount,bind,ro", ro]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            unmount()
            return None, f"cannot mount here ({' '.join(cmd[:-1])}): {r.stderr.strip()}"

    @contextlib.contextmanager
    def mounted():
        try:
            yield {"HVDP_TEST_DISK_FULL": full, "HVDP_TEST_DISK_RO": ro, "HVDP_TEST_DISK_RO_SRC": src}
        finally:
            unmount()
    return mounted(), None
