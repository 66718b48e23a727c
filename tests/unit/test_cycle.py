"""hvdp.cluster.cycle: which cycle time hvd.init() sets for Horovod's background thread, and
that hvdp.cluster.bootstrap.init sets it before Horovod's init, never over the user's."""
from hvdp.cluster import bootstrap as bs
from hvdp.cluster import cycle


def test_a_job_without_a_gpu_gets_five_ms_where_nothing_is_set():
    assert cycle.choose({}, uses_gpu=False) == "5"
    env = {}
    assert cycle.apply(lambda: False, env) == "5"
    assert env == {"HOROVOD_CYCLE_TIME": "5"}


def test_the_users_value_a_gpu_and_the_autotuner_are_left_alone():
    for env, gpu in (({"HOROVOD_CYCLE_TIME": "1"}, False), ({}, True), ({"HOROVOD_AUTOTUNE": "1"}, False)):
        before = dict(env)
        assert cycle.choose(env, uses_gpu=gpu) is None
        assert cycle.apply(lambda g=gpu: g, env) is None
        assert env == before  # nothing written
    # HOROVOD_AUTOTUNE=0 is not the autotuner
    assert cycle.choose({"HOROVOD_AUTOTUNE": "0"}, uses_gpu=False) == "5"


def test_the_gpu_question_is_not_asked_where_the_user_set_the_cycle():
    def ask():
        raise AssertionError("uses_gpu() called although HOROVOD_CYCLE_TIME is set")
    assert cycle.apply(ask, {"HOROVOD_CYCLE_TIME": "2.5"}) is None


def test_init_sets_the_cycle_before_horovods_init_and_not_once_initialised():
    seen = []
    env = {}
    bs.init(lambda **k: seen.append(env.get("HOROVOD_CYCLE_TIME")), lambda: 1, lambda: False, environ=env)
    assert seen == ["5"]  # set when Horovod's init ran
    env, seen = {}, []
    bs.init(lambda **k: seen.append(env.get("HOROVOD_CYCLE_TIME")), lambda: 1, lambda: False, environ=env,
            uses_gpu=lambda: True)
    assert seen == [None]  # a GPU: Horovod's default
    env, seen = {}, []
    bs.init(lambda **k: seen.append(env.get("HOROVOD_CYCLE_TIME")), lambda: 1, lambda: True, environ=env)
    assert seen == [None]  # already initialised: Horovod read its cycle then; nothing to change


def test_doctor_line_says_what_init_does():
    assert "HOROVOD_CYCLE_TIME=5" in cycle.describe({}, uses_gpu=False)
    assert "as set" in cycle.describe({"HOROVOD_CYCLE_TIME": "3"}, uses_gpu=False)
    assert "GPU" in cycle.describe({}, uses_gpu=True)
    assert "autotuner" in cycle.describe({"HOROVOD_AUTOTUNE": "1"}, uses_gpu=False)
