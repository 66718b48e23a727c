"""hvdp.torch under real ``horovodrun -np 2 -H localhost:2``, over Gloo and over MPI."""
import functools
import os
import subprocess
import sys
import tempfile

import pytest

from conftest import CONTROLLERS, ROOT, WORKERS, checks_passed, horovodrun, scratch_disks

pytestmark = pytest.mark.parallel

CHECKS = ["grad_average", "two_equal_one", "bpps", "broadcast", "amp", "codecs", "powersgd", "powersgd_ddp", "state",
          "nonfinite", "errors", "warmup", "sparse_unused_empty", "checkpoint",
          "save_for_other_size", "elastic_restore", "horovod_options", "freed", "overlap", "sleeping_wait"]


DISK_SKIPPED = {}  # controller -> why its job ran without the full / read-only disk check


@functools.lru_cache(maxsize=None)
def run_job(controller):
    """One job per controller runs every check (each launch costs seconds of start-up); the
    Gloo job also the full / read-only disk check where this machine can mount them.
    -> (returncode, output, the folder where save_for_other_size left its checkpoint)."""
    folder = tempfile.mkdtemp(prefix=f"hvdp-torch-{controller}-")
    disks, why = scratch_disks() if controller == "gloo" else (None, "run in the Gloo job only")
    if disks is None:
        DISK_SKIPPED[controller] = why
        rc, out = horovodrun([os.path.join(WORKERS, "torch_checks.py")] + CHECKS, controller=controller,
                             timeout=300, env={"HVDP_TEST_CKPT_DIR": folder})
        return rc, out, folder
    with disks as env:
        rc, out = horovodrun([os.path.join(WORKERS, "torch_checks.py")] + CHECKS + ["disk"], controller=controller,
                             timeout=300, env={"HVDP_TEST_CKPT_DIR": folder, **env})
    return rc, out, folder


def run_checks(controller):
    return run_job(controller)[:2]


@pytest.mark.parametrize("controller", CONTROLLERS)
@pytest.mark.parametrize("check", CHECKS)
def test_torch_check(controller, check):
    rc, out = run_checks(controller)
    passed = checks_passed(out)
    assert passed.get(check) == {"0", "1"}, f"check {check} not passed on both ranks (rc={rc}):\n{out[-4000:]}"


def test_torch_checkpoint_on_full_or_read_only_disk():
    """hvd.save_checkpoint onto a full tmpfs and a read-only mount (tests/parallel/workers/
    torch_checkpoint_checks.py, check_full_or_read_only_disk): every rank raises the same
    CheckpointWriteError naming the path and the cause, the previous checkpoint loads whole."""
    rc, out = run_checks("gloo")
    if "gloo" in DISK_SKIPPED:
        pytest.skip(DISK_SKIPPED["gloo"])
    assert checks_passed(out).get("disk") == {"0", "1"}, f"not passed on both ranks (rc={rc}):\n{out[-4000:]}"


def test_job_exit_code():
    for controller in CONTROLLERS:
        rc, out = run_checks(controller)
        assert rc == 0, out[-4000:]


@pytest.mark.parametrize("np_", [1, 3])
def test_torch_resume_at_another_world_size(np_):
    """The 2-worker checkpoint of save_for_other_size loaded by 1 and by 3 workers: the rule of
    hvdp.torch.checkpoint (the same as Keras'), checked per rank."""
    rc, out, folder = run_job("gloo")
    assert checks_passed(out).get("save_for_other_size") == {"0", "1"}, out[-4000:]
    env = {"HVDP_TEST_CKPT_DIR": folder}
    args = [os.path.join(WORKERS, "torch_checks.py"), "resume_other_size"]
    if np_ == 1:  # one worker needs no launcher
        r = subprocess.run([sys.executable] + args, capture_output=True, text=True, cwd=ROOT, timeout=120,
                           env=dict(os.environ, OMP_NUM_THREADS="1", **env))
        rc, out = r.returncode, r.stdout + r.stderr
    else:
        rc, out = horovodrun(args, np=np_, timeout=180, env=env)
    ranks = {str(r) for r in range(np_)}
    assert checks_passed(out).get("resume_other_size") == ranks and rc == 0, out[-4000:]
