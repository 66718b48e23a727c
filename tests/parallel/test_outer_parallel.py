"""hvd.OuterOptimizer (outer steps) under real ``horovodrun -np 2 -H localhost:2 --gloo``: one job per
framework (hvdp.torch; hvdp.keras on each backend) runs every check and reports each by name
(tests/parallel/workers/outer_torch.py, outer_keras.py)."""
import functools
import os

import pytest

from conftest import WORKERS, checks_passed, horovodrun

pytestmark = pytest.mark.parallel

CHECKS = ["data_parallelism", "ranks_identical_int8", "post_local_sgd", "warmup_post_local_sgd", "warmup_codec",
          "join_warmup_codec",
          "checkpoint_mid_interval", "save_checkpoint", "join", "auto", "streaming_overlap", "refusals"]
KERAS_CHECKS = ["refusals", "data_parallelism", "ranks_identical_int8", "custom_loop", "auto", "join", "checkpoint",
                "warmup_fit", "warmup_custom_loop", "checkpoint_warmup", "warmup_codec"]


@functools.lru_cache(maxsize=None)
def run_job():
    return horovodrun([os.path.join(WORKERS, "outer_torch.py")] + CHECKS, controller="gloo", timeout=300)


@pytest.mark.parametrize("check", CHECKS)
def test_outer_torch(check):
    rc, out = run_job()
    passed = checks_passed(out)
    assert passed.get(check) == {"0", "1"}, f"check {check} not passed on both ranks (rc={rc}):\n{out[-4000:]}"


@functools.lru_cache(maxsize=None)
def run_keras_job(backend):
    return horovodrun([os.path.join(WORKERS, "outer_keras.py")] + KERAS_CHECKS, controller="gloo", timeout=300,
                      env={"KERAS_BACKEND": backend})


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
@pytest.mark.parametrize("check", KERAS_CHECKS)
def test_outer_keras(backend, check):
    rc, out = run_keras_job(backend)
    passed = checks_passed(out)
    assert passed.get(check) == {"0", "1"}, f"check {check} not passed on both ranks (rc={rc}):\n{out[-4000:]}"
