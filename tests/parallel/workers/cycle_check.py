"""The ``cycle_time`` check of the torch and Keras user jobs: hvd.init() left the user's
HOROVOD_CYCLE_TIME alone, else set 5 ms on a job without a GPU (hvdp.cluster.cycle). Import it
before hvd.init(): the variable as the launcher gave it is read at import."""
import os

BEFORE_INIT = os.environ.get("HOROVOD_CYCLE_TIME")


def check(uses_gpu: bool) -> None:
    want = BEFORE_INIT or (None if uses_gpu else "5")
    got = os.environ.get("HOROVOD_CYCLE_TIME")
    assert got == want, f"HOROVOD_CYCLE_TIME after hvd.init(): {got!r}, wanted {want!r}"
