"""hvdp.keras on Keras' torch backend with shards of different lengths: ``model.fit`` with
``hvd.callbacks.JoinCallback`` (the TensorFlow backend's join checks are in test_join.py)."""
import os

import pytest

from conftest import WORKERS, horovodrun

pytestmark = pytest.mark.parallel


@pytest.mark.timeout(400)
def test_keras_torch_backend_fit_uneven_shards_with_join_callback():
    rc, out = horovodrun([os.path.join(WORKERS, "join_keras.py"), "5,4", "fit:none,int8"], timeout=360,
                         env={"KERAS_BACKEND": "torch"})
    for codec in ("none", "int8"):
        for rank in (0, 1):
            assert f"CHECK join-fit-{codec} OK rank={rank} iterations=10" in out, out[-4000:]
    assert rc == 0, out[-4000:]
