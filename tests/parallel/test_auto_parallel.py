"""compression="auto" under real ``horovodrun -np 2 -H localhost:2``, over Gloo and over MPI:
every rank takes the same decision, each bucket equals its fixed codec, a reset probes again,
the trial of the first steps ends the same on every rank,
auto on one rank and int8 on another fail together,
and 2 workers match 1 worker on the same global batch within the chosen codec's tolerance."""
import functools
import os

import pytest

from conftest import CONTROLLERS, WORKERS, checks_passed, horovodrun

pytestmark = pytest.mark.parallel

CHECKS = ["probe", "trial", "disagreement", "forced", "one_worker"]


@functools.lru_cache(maxsize=None)
def run_checks(controller):
    return horovodrun([os.path.join(WORKERS, "auto_torch.py")] + CHECKS, controller=controller, timeout=300)


@pytest.mark.parametrize("controller", CONTROLLERS)
@pytest.mark.parametrize("check", CHECKS)
def test_auto_torch(controller, check):
    rc, out = run_checks(controller)
    assert checks_passed(out).get(check) == {"0", "1"}, \
        f"check {check} not passed on both ranks (rc={rc}):\n{out[-4000:]}"
