"""powersgd with hvdp.keras's TensorFlow ops inside a traced ``tf.function`` (the state in
tf.Variables, as hvdp.keras keeps it) against the numpy reference ops: outputs and residuals,
and a non-finite step that leaves the state as it was (a select in the graph)."""
import importlib.util
import os

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from hvdp import codecs  # noqa: E402
from hvdp.reduce.lowrank import LowRankReducer  # noqa: E402
from hvdp.ops import NumpyOps  # noqa: E402
from hvdp.reduce.simcomm import FakeGroup  # noqa: E402

SHAPES = [(32, 24), (16,), (8, 4, 5), (4, 4)]
N = sum(int(np.prod(s)) for s in SHAPES)
TOL = 5e-6  # float32 in two frameworks, four steps (seen: 1.2e-6 at rank 4)


def tf_ops():
    """hvdp.keras's TF ops from their file (importing hvdp.keras would start Horovod)."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "adapters", "keras", "ops.py")
    spec = importlib.util.spec_from_file_location("_hvdp_keras_ops", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.TFOps()


class VariableStore:
    """Residuals and Qs in tf.Variables, made ahead at their sizes (as hvdp.keras's store)."""

    def __init__(self):
        self.vars = {}

    def create(self, name, n):
        self.vars[name] = tf.Variable(tf.zeros([n]), trainable=False)

    def get(self, name):
        v = self.vars.get(name)
        return None if v is None else tf.convert_to_tensor(v)

    def set(self, name, value):
        self.vars[name].assign(value)

    def snapshot(self):
        return {k: v.numpy() for k, v in self.vars.items()}

    def restore(self, data):
        for k, v in self.vars.items():
            v.assign(data.get(k, np.zeros(v.shape, np.float32)))


@pytest.mark.parametrize("rank", [2, 4])  # Gram-Schmidt and QR
def test_traced_steps_match_numpy(rank):
    codec = codecs.get("powersgd", rank=rank)
    ref = LowRankReducer(codec, NumpyOps(), FakeGroup(1).comms[0], True)
    red = LowRankReducer(codec, tf_ops(), FakeGroup(1).comms[0], True,
                         worker_store=VariableStore(), server_store=VariableStore())
    for r in (ref, red):
        r.set_shapes({"b0": SHAPES})
    server, worker = red.store_sizes("b0", N)
    red.worker.create("b0", worker)
    red.server.create("b0", server)

    @tf.function
    def step(flat):
        pend = red.start("b0", flat)
        red.exchange(pend)
        return red.finish(pend)

    rng = np.random.default_rng(0)
    for t in range(4):
        g = (rng.standard_normal(N) * (t + 1)).astype(np.float32)
        pend = ref.start("b0", g.copy())
        ref.exchange(pend)
        want = ref.finish(pend)
        got = step(tf.constant(g)).numpy()
        scale = float(np.abs(want).max())
        assert float(np.abs(got - want).max()) <= TOL * scale, t
        assert float(np.abs(red.worker.get("b0").numpy() - ref.worker.get("b0")).max()) <= TOL * scale, t
    before = red.worker.snapshot()["b0"], red.server.snapshot()["b0"]
    g[5] = np.inf
    assert not np.isfinite(step(tf.constant(g)).numpy()).all()
    np.testing.assert_array_equal(red.worker.snapshot()["b0"], before[0])
    np.testing.assert_array_equal(red.server.snapshot()["b0"], before[1])
