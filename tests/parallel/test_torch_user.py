"""What a demanding torch user hits (issue 18), under ``horovodrun -np 2`` over Gloo and MPI:
two optimizers in flight, bfloat16 models, non-contiguous parameters, requires_grad changed
after the optimizer was made, GradScaler's skipped steps (issue 26). (Horovod's module-level API
against plain Horovod: test_horovod_compat.py.) The checks are in
``workers/torch_user_checks.py``."""
import functools
import os

import pytest

from conftest import CONTROLLERS, WORKERS, checks_passed, horovodrun

pytestmark = pytest.mark.parallel

CHECKS = ["cycle_time", "two_optimizers", "bf16", "bf16_join", "noncontiguous", "requires_grad",
          "fresh_state_broadcast", "amp_skipped_steps"]


@functools.lru_cache(maxsize=None)
def run_checks(controller):
    # one job per controller runs every check (start-up dominates a job's time); a check that
    # fails ends the job, and the checks after it are reported as not passed
    return horovodrun([os.path.join(WORKERS, "torch_user_checks.py")] + CHECKS, controller=controller, timeout=400)


@pytest.mark.parametrize("controller", CONTROLLERS)
@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.timeout(460)
def test_torch_user(controller, check):
    rc, out = run_checks(controller)
    assert checks_passed(out).get(check) == {"0", "1"}, \
        f"check {check} not passed on both ranks (rc={rc}):\n{out[-5000:]}"
    assert rc == 0, out[-5000:]
