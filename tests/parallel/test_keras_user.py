"""What a demanding Keras user hits (issue 18), under ``horovodrun -np 2`` over Gloo and MPI:
saved models loaded back, custom Horovod compressors, the tape under XLA, refreezing with int8,
Horovod's module-level collectives with compression=, local variables, the broadcast callback's
local_variables and a lazily built model, the elastic callbacks and KerasState's restore()
after sync() (issue 27).
The checks are in ``workers/keras_user_checks.py``."""
import functools
import os

import pytest

from conftest import CONTROLLERS, WORKERS, checks_passed, horovodrun

pytestmark = pytest.mark.parallel

CHECKS = ["cycle_time", "save_load", "compressor", "refreeze", "module_collectives", "local_vars", "broadcast_local",
          "lazy_model", "elastic_callbacks", "elastic_restore_after_sync", "freed"]


@functools.lru_cache(maxsize=None)
def run_checks(controller):
    # one job per controller runs every check (start-up dominates a job's time); a check that
    # fails ends the job, and the checks after it are reported as not passed
    return horovodrun([os.path.join(WORKERS, "keras_user_checks.py")] + CHECKS, controller=controller, timeout=500)


@pytest.mark.parametrize("controller", CONTROLLERS)
@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.timeout(560)
def test_keras_user(controller, check):
    rc, out = run_checks(controller)
    assert checks_passed(out).get(check) == {"0", "1"}, \
        f"check {check} not passed on both ranks (rc={rc}):\n{out[-5000:]}"
    assert rc == 0, out[-5000:]
