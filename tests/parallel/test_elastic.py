"""Elastic training on fake hosts: a worker killed mid-epoch, and a 2 -> 3 -> 2 resize."""
import pytest

import elastic_harness as eh

pytestmark = pytest.mark.parallel

NUM_TRAIN = 1347  # digits: 1797 samples, 25% held out (examples/torch_digits.load_data)
# the Keras example on both of hvdp.keras's backends
SCRIPTS = ["torch_elastic.py", "keras_elastic.py", "keras_elastic.py@torch"]


def script_env(script):
    """'keras_elastic.py@torch' -> ('keras_elastic.py', {'KERAS_BACKEND': 'torch'})."""
    name, _, backend = script.partition("@")
    return name, ({"KERAS_BACKEND": backend} if backend else {})


@pytest.mark.parametrize("script", SCRIPTS)
def test_fault_worker_killed_mid_epoch(tmp_path, script):
    script, env = script_env(script)
    schedule = [(0, ["localhost:2", "127.0.0.1:1"])]
    work = tmp_path / "run"
    rc, out, kill_time = eh.run(str(work), schedule, np_=3, kill_host="127.0.0.1", kill_after=40,
                                script=script, timeout=400, env_extra=env)
    if rc != 0 and "gloo::EnforceNotMet" in out:
        # Known, not fixed (README, elastic section): once in four runs here (2026-11-30) a
        # survivor's Gloo transport thread aborted the process (std::terminate on a message-size
        # check) when its peer was killed mid-collective, which Horovod cannot turn into a
        # HorovodInternalError. One more run, in a fresh directory; any other failure, or this
        # one twice, fails the test.
        work = tmp_path / "retry"
        rc, out, kill_time = eh.run(str(work), schedule, np_=3, kill_host="127.0.0.1", kill_after=40,
                                    script=script, timeout=400, env_extra=env)
    assert kill_time is not None
    assert rc == 0, out[-4000:]
    steps, finals = eh.audit(str(work), NUM_TRAIN, 3)
    before = [s for s in steps if s["size"] == 3]
    after = [s for s in steps if s["size"] == 2]  # committed after the reset to 2 workers
    assert before and after and after[0]["t"] > kill_time, "did not continue on 2 workers"
    assert all(s["t"] > kill_time for s in after)
    recovery = after[0]["t"] - kill_time  # kill -> first step committed by the survivors
    # continues from the committed state: no jump back to the first steps' loss
    first = sum(s["loss"] for s in steps[:5]) / 5
    assert after[0]["loss"] < 0.5 * first, (after[0]["loss"], first)
    assert after[0]["commit"] == before[-1]["commit"] + 1
    print(f"\nfault run ({script}): kill at commit {before[-1]['commit']}, recovery {recovery:.2f} s, "
          f"{len(steps)} committed steps, losses {first:.3f} -> {after[0]['loss']:.3f}, "
          f"{len(finals)} ranks with identical final parameters")


@pytest.mark.parametrize("script", SCRIPTS)
def test_resize_two_three_two(tmp_path, script):
    script, env = script_env(script)
    schedule = [(0, ["localhost:2"]), (15, ["localhost:2", "127.0.0.1:1"]), (45, ["localhost:2"])]
    rc, out, _ = eh.run(str(tmp_path), schedule, np_=2, step_sleep=0.06, script=script, timeout=400,
                        env_extra=env)
    assert rc == 0, out[-4000:]
    steps, _ = eh.audit(str(tmp_path), NUM_TRAIN, 3)
    sizes = [s["size"] for s in steps]
    assert sizes[0] == 2 and 3 in sizes and sizes[-1] == 2, sizes
    print(f"\nresize run ({script}): sizes by step {sizes[0]} -> {max(sizes)} -> {sizes[-1]}, "
          f"{len(steps)} committed steps")
