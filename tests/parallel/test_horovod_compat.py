"""The compatibility suite (issue 27): what a Horovod script calls, on hvdp and on plain Horovod
in the same job, the results compared — so a difference shows as a failing pair. torch against
horovod.torch (workers/torch_compat_checks.py) over Gloo and MPI; Keras against
horovod.tensorflow.keras on the TensorFlow backend, and on the torch backend against what numpy
gives (workers/keras_compat_checks.py). What differs on purpose is in docs/compatibility.md."""
import functools
import os

import pytest

from conftest import CONTROLLERS, WORKERS, checks_passed, horovodrun

pytestmark = pytest.mark.parallel

TORCH = ["api_surface", "module_collectives", "compressor_contract", "optimizer_args", "sparse_adam",
         "broadcasts", "elastic_sampler", "join_plain"]
KERAS = ["api_surface", "collectives"]


@functools.lru_cache(maxsize=None)
def run_job(worker, checks, controller="gloo", backend=None):
    # one job runs every check (start-up dominates); a failing check ends it, and the checks
    # after it are reported as not passed
    env = {"KERAS_BACKEND": backend} if backend else None
    return horovodrun([os.path.join(WORKERS, worker)] + list(checks), controller=controller, timeout=400, env=env)


def _passed(result, check):
    rc, out = result
    assert checks_passed(out).get(check) == {"0", "1"}, \
        f"check {check} not passed on both ranks (rc={rc}):\n{out[-5000:]}"
    assert rc == 0, out[-5000:]


@pytest.mark.parametrize("controller", CONTROLLERS)
@pytest.mark.parametrize("check", TORCH)
@pytest.mark.timeout(460)
def test_torch_matches_horovod(controller, check):
    _passed(run_job("torch_compat_checks.py", tuple(TORCH), controller), check)


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
@pytest.mark.parametrize("check", KERAS)
@pytest.mark.timeout(460)
def test_keras_matches_horovod(backend, check):
    _passed(run_job("keras_compat_checks.py", tuple(KERAS), backend=backend), check)
