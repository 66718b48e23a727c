"""Uneven inputs with ``hvd.join()`` (issue 17), every codec, both adapters, Gloo and MPI.

Two-rank jobs make the optimizer as a Horovod script does, without ``uneven_inputs`` (issue 27:
the default turns the join control on); the three-rank jobs pass ``uneven_inputs=True``; the
refusal jobs ``uneven_inputs=False``. Each job runs rank r for ``steps[r]`` steps then joins;
the workers check that the ranks end identical, the residual rule, and the final parameters
against a reference that replays every rank's per-step contributions (``workers/join_reference.py``).
"""
import functools
import os
import re

import pytest

from conftest import CONTROLLERS, WORKERS, checks_passed, horovodrun

pytestmark = pytest.mark.parallel

CODECS = ["none", "fp16", "bf16", "int8", "topk"]
ALL = ",".join(CODECS)
# Two-rank jobs that end normally share one job per worker and controller (each mode in turn:
# every run joins, and the next starts); a refusal ends its job, so it has one of its own.
TORCH_2 = ("5,4", f"default:{ALL}", "adam:int8,topk,none")
KERAS_2 = ("5,4", f"loop:{ALL}", f"fit:{ALL}", "nojoin:int8")


@functools.lru_cache(maxsize=None)
def job(worker, steps, *args, controller="gloo"):
    np_ = len(steps.split(","))
    # under pytest-timeout's 300 s (setup.cfg), so a hang is reported with the job's output
    return horovodrun([os.path.join(WORKERS, worker), steps, *args], np=np_, controller=controller,
                      timeout=270)


def assert_all_ranks(out, rc, names, np_, how=None):
    passed = checks_passed(out)
    want = {str(r) for r in range(np_)}
    for name in names:
        assert passed.get(name) == want, f"{name} not passed on every rank (rc={rc}):\n{out[-5000:]}"
        if how is not None:  # the optimizer was made the way the test says
            for r in range(np_):
                assert re.search(rf"CHECK {name} OK rank={r} uneven_inputs={how} ", out), out[-5000:]
    assert rc == 0, out[-5000:]


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_torch_5_vs_4_steps_every_codec_without_opt_in(controller):
    """A Horovod script: no uneven_inputs argument, hvd.join() at the end of uneven shards."""
    rc, out = job("join_torch.py", *TORCH_2, controller=controller)
    assert "JoinRefused" not in out, out[-5000:]
    assert_all_ranks(out, rc, [f"join-{c}" for c in CODECS], 2, how="default")


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_torch_three_ranks_three_step_counts(controller):
    rc, out = job("join_torch.py", "5,3,4", f"opt-in:{ALL}", controller=controller)
    assert_all_ranks(out, rc, [f"join-{c}" for c in CODECS], 3, how="True")


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_torch_optimizer_state_identical_after_join(controller):
    rc, out = job("join_torch.py", *TORCH_2, controller=controller)
    assert_all_ranks(out, rc, [f"join-adam-{c}" for c in ("int8", "topk", "none")], 2)


def assert_refused_on_every_rank(rc, out):
    assert rc != 0, out[-3000:]
    assert "Segmentation fault" not in out and "signal 11" not in out, out[-3000:]
    for rank in (0, 1):  # horovodrun prefixes each line with [rank] (Gloo) or [1,rank] (MPI)
        lines = [ln for ln in out.splitlines() if re.match(rf"\[(\d+,)?{rank}\]", ln)]
        assert any("uneven_inputs=False" in ln for ln in lines), f"rank {rank} did not say why:\n{out[-4000:]}"
    # the way out is dropping uneven_inputs=False: no message asks for uneven_inputs=True any more
    said = [ln for ln in out.splitlines() if "REFUSED" in ln or "JoinRefused" in ln]
    assert said and not any("uneven_inputs=True" in ln for ln in said), out[-4000:]


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_torch_join_with_uneven_inputs_false_is_a_clear_error_on_every_rank(controller):
    assert_refused_on_every_rank(*job("join_torch.py", "5,4", "refuse:int8", controller=controller))


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_keras_join_with_uneven_inputs_false_is_a_clear_error_on_every_rank(controller):
    assert_refused_on_every_rank(*job("join_keras.py", "5,4", "refuse:int8", controller=controller))


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_keras_loop_5_vs_4_steps_every_codec_without_opt_in(controller):
    """A Horovod script: no uneven_inputs argument, hvd.join() at the end of uneven shards."""
    rc, out = job("join_keras.py", *KERAS_2, controller=controller)
    assert "JoinRefused" not in out, out[-5000:]
    assert_all_ranks(out, rc, [f"join-loop-{c}" for c in CODECS], 2, how="default")


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_keras_loop_three_ranks(controller):
    rc, out = job("join_keras.py", "5,3,4", f"loopin:{ALL}", controller=controller)
    assert_all_ranks(out, rc, [f"join-loop-{c}" for c in CODECS], 3, how="True")


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_keras_fit_uneven_shards_with_join_callback(controller):
    """model.fit + JoinCallback, the optimizer made without uneven_inputs."""
    rc, out = job("join_keras.py", *KERAS_2, controller=controller)
    assert_all_ranks(out, rc, [f"join-fit-{c}" for c in CODECS], 2)


def test_keras_fit_uneven_shards_without_it_is_refused():
    rc, out = job("join_keras.py", *KERAS_2, controller="gloo")
    assert_all_ranks(out, rc, ["join-nojoin-int8"], 2)
    assert re.search(r"steps_per_epoch=4", out), out[-3000:]
