"""hvdp.keras under real ``horovodrun -np 2 -H localhost:2``, over Gloo and over MPI, on Keras'
TensorFlow and torch backends (one job per controller and backend runs every check)."""
import functools
import json
import os
import subprocess
import sys
import tempfile

import pytest

from conftest import CONTROLLERS, ROOT, WORKERS, checks_passed, horovodrun, scratch_disks

pytestmark = pytest.mark.parallel

BACKENDS = ["tensorflow", "torch"]
CHECKS = ["numpy_collectives", "stats_shape", "fit_equal", "fit_bpps", "custom_loop", "broadcast", "metric_average",
          "warmup", "codecs", "powersgd", "mixed_precision", "checkpoint", "resume",
          "save_for_other_size", "syncbn"]


DISK_SKIPPED = {}  # (controller, backend) -> why its job ran without the full / read-only disk check


@functools.lru_cache(maxsize=None)
def run_checks(controller, backend):
    """The Gloo jobs also run the full / read-only disk check where this machine can mount them.
    -> (returncode, output, the folder where save_for_other_size left its checkpoint)."""
    folder = tempfile.mkdtemp(prefix=f"hvdp-keras-{backend}-{controller}-")
    env = {"KERAS_BACKEND": backend, "HVDP_TEST_CKPT_DIR": folder}
    disks, why = scratch_disks() if controller == "gloo" else (None, "run in the Gloo jobs only")
    if disks is None:
        DISK_SKIPPED[controller, backend] = why
        rc, out = horovodrun([os.path.join(WORKERS, "keras_checks.py")] + CHECKS, controller=controller,
                             timeout=540, env=env)
        return rc, out, folder
    with disks as disk_env:
        rc, out = horovodrun([os.path.join(WORKERS, "keras_checks.py")] + CHECKS + ["disk"], controller=controller,
                             timeout=540, env={**env, **disk_env})
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
def test_keras_checkpoint_on_full_or_read_only_disk(backend):
    """hvd.save_checkpoint and hvd.callbacks.ModelCheckpoint onto a full tmpfs and a read-only
    mount (tests/parallel/workers/keras_checkpoint_checks.py, check_full_or_read_only_disk): every
    rank raises the same CheckpointWriteError naming the path and the cause, the previous
    checkpoints load whole."""
    rc, out, _ = run_checks("gloo", backend)
    if ("gloo", backend) in DISK_SKIPPED:
        pytest.skip(DISK_SKIPPED["gloo", backend])
    assert checks_passed(out).get("disk") == {"0", "1"}, f"not passed on both ranks (rc={rc}):\n{out[-4000:]}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("np_", [1, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_resume_at_another_world_size(backend, np_):
    """The 2-worker checkpoint of save_for_other_size, loaded by 1 and by 3 workers: the rule of
    hvdp.keras.checkpoint (the same as torch's), checked per rank."""
    rc, out, folder = run_checks("gloo", backend)
    assert checks_passed(out).get("save_for_other_size") == {"0", "1"}, out[-4000:]
    env = {"KERAS_BACKEND": backend, "HVDP_TEST_CKPT_DIR": folder}
    args = [os.path.join(WORKERS, "keras_checks.py"), "resume_other_size"]
    if np_ == 1:  # one worker needs no launcher
        r = subprocess.run([sys.executable] + args, capture_output=True, text=True, cwd=ROOT, timeout=240,
                           env=dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", **env))
        rc, out = r.returncode, r.stdout + r.stderr
    else:
        rc, out = horovodrun(args, np=np_, timeout=300, env=env)
    ranks = {str(r) for r in range(np_)}
    assert checks_passed(out).get("resume_other_size") == ranks and rc == 0, out[-4000:]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_digits_int8_reaches_accuracy(tmp_path, backend):
    res = tmp_path / "res.json"
    rc, out = horovodrun([os.path.join(ROOT, "examples", "keras_digits.py"), "--compression", "int8",
                          "--json-out", str(res)], timeout=500, env={"KERAS_BACKEND": backend})
    assert rc == 0, out[-3000:]
    got = json.loads(res.read_text())
    assert got["size"] == 2 and got["backend"] == backend and got["test_accuracy"] >= 0.90, got
