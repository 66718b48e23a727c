"""hvdp.torch under torchrun, without horovodrun: hvd.init() bootstraps Horovod's Gloo controller
from torchrun's variables (hvdp.bootstrap). Two jobs: the int8 checks under
``torchrun --standalone --nproc-per-node 2``, and the same script under ``horovodrun --gloo``,
which must give the same losses bit for bit."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, WORKERS, checks_passed, horovodrun

pytestmark = pytest.mark.parallel
SCRIPT = os.path.join(WORKERS, "torchrun_checks.py")
CHECKS = ("size", "allreduce", "int8_step", "ranks_identical")
LAUNCHERS = ("HOROVOD_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_env():
    """This environment without any launcher's variables (the test may itself run under one)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(LAUNCHERS) and k not in TORCHRUN_VARS}


def losses(out):
    found = re.findall(r"LOSSES (.+)", out)
    assert len(found) == 1, out[-3000:]
    return found[0].split()


def test_torchrun_matches_horovodrun_with_int8():
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("torchrun not found next to this interpreter: install torch")
    env = dict(clean_env(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        r = subprocess.run([exe, "--standalone", "--nproc-per-node", "2", SCRIPT], capture_output=True,
                           text=True, timeout=240, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun timed out after 240s (a hang):\n{(e.stdout or b'')[-3000:]!r}")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    seen = checks_passed(out)
    assert all(seen.get(c) == {"0", "1"} for c in CHECKS), (seen, out[-3000:])
    assert "size=2 local_size=2 controller=gloo" in out
    rc, hout = horovodrun([SCRIPT], controller="gloo", env={})
    assert rc == 0 and all(checks_passed(hout).get(c) == {"0", "1"} for c in CHECKS), hout[-3000:]
    assert losses(out) == losses(hout)  # the same job, bit for bit, under either launcher
