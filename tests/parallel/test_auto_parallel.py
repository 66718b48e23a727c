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


def test_auto_through_elastic_resizes(tmp_path, monkeypatch):
    """auto probes again after every reset (2 -> 3 -> 2 workers): the probe's and the trial's
    collectives line up on the new set of workers (no hang) and training goes on."""
    import elastic_harness as eh
    # Gloo's rendezvous after a reset takes longer than the harness' 10 s on a loaded machine
    monkeypatch.setenv("HOROVOD_GLOO_TIMEOUT_SECONDS", "60")
    schedule = [(0, ["localhost:2"]), (15, ["localhost:2", "127.0.0.1:1"]), (45, ["localhost:2"])]
    rc, out, _ = eh.run(str(tmp_path), schedule, np_=2, step_sleep=0.06, script="torch_elastic.py",
                        timeout=400, extra=("--compression", "auto"))
    assert rc == 0, out[-4000:]
    steps, _ = eh.audit(str(tmp_path), 1347, 3)
    sizes = [s["size"] for s in steps]
    assert sizes[0] == 2 and 3 in sizes and sizes[-1] == 2, sizes


# hvdp.keras: per bucket with the trial on the torch backend (its step is eager), one codec for
# the model chosen before the step is traced on TF (TF on both controllers, torch over Gloo)
KERAS_JOBS = [("gloo", "tensorflow"), ("mpi", "tensorflow"), ("gloo", "torch")]
KERAS_CHECKS = ["probe", "trial", "forced", "disagreement"]


@functools.lru_cache(maxsize=None)
def run_keras(controller, backend):
    return horovodrun([os.path.join(WORKERS, "auto_keras.py")] + KERAS_CHECKS, controller=controller,
                      timeout=400, env={"KERAS_BACKEND": backend})


@pytest.mark.parametrize("controller,backend", KERAS_JOBS)
@pytest.mark.parametrize("check", KERAS_CHECKS)
def test_auto_keras(controller, backend, check):
    rc, out = run_keras(controller, backend)
    assert checks_passed(out).get(check) == {"0", "1"}, \
        f"check {check} not passed on both ranks ({backend}, rc={rc}):\n{out[-4000:]}"
