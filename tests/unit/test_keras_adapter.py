"""The Keras adapter without processes: TF ops vs the numpy reference; unsupported set-ups."""
import os
import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from hvdp import codecs  # noqa: E402
from hvdp.ops import NumpyOps  # noqa: E402


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "int8", "topk"])
def test_tf_ops_match_numpy_reference(name):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "adapters", "keras"))
    from ops import TFOps
    codec = codecs.get(name)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(4096) * rng.uniform(0.01, 100, 4096)).astype(np.float32)
    x[100] = np.inf
    ref = codec.encode(NumpyOps(), x)
    got = codec.encode(TFOps(), tf.constant(x)).numpy()
    np.testing.assert_array_equal(got, ref)  # eager: the same bytes on the wire
    dec = codec.decode(TFOps(), tf.constant(ref), x.size).numpy()
    dref = codec.decode(NumpyOps(), ref, x.size)
    np.testing.assert_array_equal(np.isnan(dec), np.isnan(dref))
    np.testing.assert_array_equal(dec[~np.isnan(dec)], dref[~np.isnan(dref)])


def test_non_tensorflow_backend_is_a_clear_error():
    env = dict(os.environ, KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="3")
    r = subprocess.run([sys.executable, "-c", "import hvdp.keras"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode != 0
    assert "KERAS_BACKEND=tensorflow" in r.stderr, r.stderr[-2000:]
