"""Helpers for tests that run real ``horovodrun -np 2 -H localhost:2`` jobs."""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(ROOT, "tests", "parallel", "workers")
CONTROLLERS = ["gloo", "mpi"]


def horovodrun(args, np=2, controller="gloo", timeout=240, env=None):
    """Run ``horovodrun`` and return (returncode, combined output); a hang fails at ``timeout``."""
    exe = shutil.which("horovodrun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    if exe is None:
        pytest.skip("horovodrun not found: run `make setup`")
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
                    **(env or {}))
    full_env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + full_env["PATH"]
    cmd = [exe, "-np", str(np), "-H", f"localhost:{np}", f"--{controller}", sys.executable] + list(args)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"horovodrun timed out after {timeout}s (a hang):\n{out[-3000:]}")
    return r.returncode, r.stdout + r.stderr


def checks_passed(output):
    """Names of the checks every rank reported as passed ('CHECK <name> OK rank=<r>')."""
    seen = {}
    for name, rank in re.findall(r"CHECK (\S+) OK rank=(\d+)", output):
        seen.setdefault(name, set()).add(rank)
    return seen
