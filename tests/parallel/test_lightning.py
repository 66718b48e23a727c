"""hvdp.lightning.HorovodStrategy under real ``horovodrun -np 2 -H localhost:2 --gloo``: one job runs
every check in turn and reports each by name (tests/parallel/workers/lightning_checks.py): the
Trainer's training equals hvdp.torch's plain loop (compression none and int8, gradient
accumulation, bf16-mixed, manual optimization), a resumed run equals the uninterrupted one,
metrics logged with sync_dist agree on the ranks, what the strategy cannot do is refused; and
HorovodFabricStrategy's loop equals the plain one and resumes bit for bit."""
import functools
import os

import pytest

from conftest import WORKERS, checks_passed, horovodrun

pytest.importorskip("lightning")
pytestmark = pytest.mark.parallel

CHECKS = ["same_as_plain_none", "same_as_plain_int8", "accumulate", "bf16_mixed", "outer", "outer_warmup", "manual",
          "checkpoint_resume", "metrics", "refusals", "fabric"]


@functools.lru_cache(maxsize=None)
def run_job():
    return horovodrun([os.path.join(WORKERS, "lightning_checks.py")] + CHECKS, controller="gloo", timeout=300)


@pytest.mark.parametrize("check", CHECKS)
def test_lightning_strategy(check):
    rc, out = run_job()
    passed = checks_passed(out)
    assert passed.get(check) == {"0", "1"}, f"check {check} not passed on both ranks (rc={rc}):\n{out[-4000:]}"
