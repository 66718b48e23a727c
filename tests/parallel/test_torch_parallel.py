"""hvdp.torch under real ``horovodrun -np 2 -H localhost:2``, over Gloo and over MPI."""
import functools
import os

import pytest

from conftest import CONTROLLERS, WORKERS, checks_passed, horovodrun

pytestmark = pytest.mark.parallel

CHECKS = ["grad_average", "two_equal_one", "bpps", "broadcast", "amp", "codecs", "powersgd", "state",
          "nonfinite", "errors", "warmup", "sparse_unused_empty", "checkpoint",
          "elastic_restore", "horovod_options", "freed"]


@functools.lru_cache(maxsize=None)
def run_checks(controller):
    """One job per controller runs every check (each launch costs seconds of start-up)."""
    return horovodrun([os.path.join(WORKERS, "torch_checks.py")] + CHECKS, controller=controller,
                      timeout=300)


@pytest.mark.parametrize("controller", CONTROLLERS)
@pytest.mark.parametrize("check", CHECKS)
def test_torch_check(controller, check):
    rc, out = run_checks(controller)
    passed = checks_passed(out)
    assert passed.get(check) == {"0", "1"}, f"check {check} not passed on both ranks (rc={rc}):\n{out[-4000:]}"


def test_job_exit_code():
    for controller in CONTROLLERS:
        rc, out = run_checks(controller)
        assert rc == 0, out[-4000:]
