"""hvdp.keras under real ``horovodrun -np 2 -H localhost:2``, over Gloo and over MPI."""
import functools
import json
import os

import pytest

from conftest import CONTROLLERS, ROOT, WORKERS, checks_passed, horovodrun

pytestmark = pytest.mark.parallel

CHECKS = ["fit_equal", "fit_bpps", "broadcast", "metric_average", "warmup", "codecs", "mixed_precision",
          "checkpoint"]


@functools.lru_cache(maxsize=None)
def run_checks(controller):
    return horovodrun([os.path.join(WORKERS, "keras_checks.py")] + CHECKS, controller=controller,
                      timeout=400)


@pytest.mark.parametrize("controller", CONTROLLERS)
@pytest.mark.parametrize("check", CHECKS)
def test_keras_check(controller, check):
    rc, out = run_checks(controller)
    assert checks_passed(out).get(check) == {"0", "1"}, \
        f"check {check} not passed on both ranks (rc={rc}):\n{out[-4000:]}"


def test_keras_digits_int8_reaches_accuracy(tmp_path):
    res = tmp_path / "res.json"
    rc, out = horovodrun([os.path.join(ROOT, "examples", "keras_digits.py"), "--compression", "int8",
                          "--json-out", str(res)], timeout=400)
    assert rc == 0, out[-3000:]
    got = json.loads(res.read_text())
    assert got["size"] == 2 and got["test_accuracy"] >= 0.90, got
