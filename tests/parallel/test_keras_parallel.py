"""hvdp.keras under real ``horovodrun -np 2 -H localhost:2``, over Gloo and over MPI, on Keras'
TensorFlow and torch backends (one job per controller and backend runs every check)."""
import functools
import json
import os
import subprocess
import sys
import tempfile

import pytest

from conftest import CONTROLLERS, ROOT, WORKERS, checks_passed, horovodrun

pytestmark = pytest.mark.parallel

BACKENDS = ["tensorflow", "torch"]
CHECKS = ["numpy_collectives", "stats_shape", "fit_equal", "fit_bpps", "custom_loop", "broadcast", "metric_average",
          "warmup", "codecs", "powersgd", "mixed_precision", "checkpoint", "resume", "syncbn"]


@functools.lru_cache(maxsize=None)
def run_checks(controller, backend):
    """-> (returncode, output, the folder where the resume check left its checkpoint)."""
    folder = tempfile.mkdtemp(prefix=f"hvdp-keras-{backend}-{controller}-")
    rc, out = horovodrun([os.path.join(WORKERS, "keras_checks.py")] + CHECKS, controller=controller,
                         timeout=540, env={"KERAS_BACKEND": backend, "HVDP_TEST_CKPT_DIR": folder})
    return rc, out, folder


@pytest.mark.timeout(600)  # the first test of a (controller, backend) pair runs the whole job
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("controller", CONTROLLERS)
@pytest.mark.parametrize("check", CHECKS)
def test_keras_check(controller, backend, check):
    rc, out, _ = run_checks(controller, backend)
    assert checks_passed(out).get(check) == {"0", "1"}, \
        f"check {check} not passed on both ranks ({backend}, rc={rc}):\n{out[-4000:]}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_resume_at_another_world_size(backend):
    """The 2-worker checkpoint of the resume check, loaded by 1 worker: the documented rule."""
    rc, out, folder = run_checks("gloo", backend)
    assert checks_passed(out).get("resume") == {"0", "1"}, out[-4000:]
    env = dict(os.environ, KERAS_BACKEND=backend, HVDP_TEST_CKPT_DIR=folder, OMP_NUM_THREADS="1",
               TF_CPP_MIN_LOG_LEVEL="2")
    r = subprocess.run([sys.executable, os.path.join(WORKERS, "keras_checks.py"), "resume_other_size"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert "CHECK resume_other_size OK rank=0" in r.stdout, (r.stdout + r.stderr)[-4000:]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_digits_int8_reaches_accuracy(tmp_path, backend):
    res = tmp_path / "res.json"
    rc, out = horovodrun([os.path.join(ROOT, "examples", "keras_digits.py"), "--compression", "int8",
                          "--json-out", str(res)], timeout=500, env={"KERAS_BACKEND": backend})
    assert rc == 0, out[-3000:]
    got = json.loads(res.read_text())
    assert got["size"] == 2 and got["backend"] == backend and got["test_accuracy"] >= 0.90, got
