"""The Keras adapter without processes: TF ops vs the numpy reference; unsupported set-ups;
Horovod's names reachable on both backends."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from hvdp import codecs  # noqa: E402
from hvdp.ops import NumpyOps  # noqa: E402


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "int8", "int4", "topk"])
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


def _run(code_or_file, backend, timeout=240):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1")
    args = [code_or_file] if code_or_file.endswith(".py") else ["-c", code_or_file]
    return subprocess.run([sys.executable] + args, capture_output=True, text=True, env=env, timeout=timeout)


def test_jax_backend_is_a_clear_error_naming_the_supported_ones():
    r = _run("import hvdp.keras", "jax")
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "KERAS_BACKEND=tensorflow or KERAS_BACKEND=torch" in r.stderr, \
        r.stderr[-2000:]


# names Horovod's modules have that hvdp.keras cannot offer on a backend, and why
NOT_ON = {"torch": {"collective": ["broadcast_object_fn"]}}  # horovod.torch has no such function


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_every_horovod_keras_and_collective_name_is_reachable(backend):
    """hvdp.keras vs horovod.tensorflow.keras (module and callbacks) and horovod.tensorflow's
    collective API (ops, op constants, process sets, SyncBatchNormalization, ...)."""
    r = _run(os.path.join(os.path.dirname(__file__), "keras_names_probe.py"), backend)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["backend"] == backend
    assert got["counts"][0] > 30 and got["counts"][1] >= 5 and got["counts"][2] > 20, got["counts"]
    for kind in ("keras", "callbacks", "collective"):
        assert got[kind] == NOT_ON.get(backend, {}).get(kind, []), (kind, got[kind])


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_compression_members_keep_horovods_compressor_contract(backend):
    """hvdp.keras's hvd.Compression.fp16 / .none compress and decompress the backend's tensors as
    its Horovod's compressors do; int8 refuses, naming what to use."""
    code = ("import numpy as np, hvdp.keras as hvd\n"
            "from hvdp.keras.backend import BACKEND as B\n"
            "x = (np.random.default_rng(1).standard_normal(9) * 1e3)\n"
            "ts = ([__import__('tensorflow').constant(x, dtype=d) for d in ('float32', 'float64', 'int32')]\n"
            "      if B.name == 'tensorflow' else [__import__('torch').tensor(x)])\n"
            "for t in ts:\n"
            "    for ours, theirs in ((hvd.Compression.fp16, B.hvd.Compression.fp16),\n"
            "                         (hvd.Compression.none, B.hvd.Compression.none)):\n"
            "        (a, ca), (b, cb) = ours.compress(t), theirs.compress(t)\n"
            "        assert a.dtype == b.dtype and ca == cb and np.array_equal(np.asarray(a), np.asarray(b))\n"
            "        back, ref = ours.decompress(a, ca), theirs.decompress(b, cb)\n"
            "        assert back.dtype == ref.dtype == t.dtype and np.array_equal(np.asarray(back), np.asarray(ref))\n"
            "try:\n"
            "    hvd.Compression.int8.compress(ts[0])\n"
            "except ValueError as e:\n"
            "    assert 'use hvd.Compression.fp16' in str(e)\n"
            "else:\n"
            "    raise AssertionError('int8 compressed')\n"
            "print('SAME', len(ts))")
    r = _run(code, backend)
    assert r.stdout.strip().endswith("SAME " + ("3" if backend == "tensorflow" else "1")), r.stderr[-3000:]


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_module_collectives_are_under_the_stall_watchdog(backend):
    """hvd.allreduce & co. as hvdp.keras exports them: each eager call a wait of the stall
    watchdog named after the collective and its name argument (Horovod refuses, not initialized);
    a call while a graph is traced is not one."""
    code = ("import contextlib, json, numpy as np, hvdp.keras as hvd\n"
            "from hvdp.keras.agreement import WATCHDOG\n"
            "seen = []\n"
            "@contextlib.contextmanager\n"
            "def waiting(name):\n"
            "    seen.append(name)\n"
            "    yield\n"
            "WATCHDOG.waiting = waiting\n"
            "x = np.ones(2, 'float32')\n"
            "for call in (lambda: hvd.allreduce(x, 'loss'), lambda: hvd.allgather(x),\n"
            "             lambda: hvd.broadcast(x, 0, 'w'), lambda: hvd.grouped_allreduce([x], name='g'),\n"
            "             lambda: hvd.broadcast_object(1, 0, name='cfg')):\n"
            "    try:\n"
            "        call()\n"
            "    except Exception as e:\n"
            "        assert 'not been initialized' in str(e) or 'not initialized' in str(e), repr(e)\n"
            "if hvd._B.name == 'tensorflow':\n"
            "    import tensorflow as tf\n"
            "    try:  # traced: not a wait (Horovod may refuse while the op is built)\n"
            "        tf.function(lambda t: hvd.allreduce(t, name='traced')).get_concrete_function(tf.TensorSpec([2]))\n"
            "    except ValueError as e:\n"
            "        assert 'not been initialized' in str(e), repr(e)\n"
            "print('SEEN', json.dumps(seen))")
    r = _run(code, backend)
    line = [s for s in r.stdout.splitlines() if s.startswith("SEEN ")]
    assert line, r.stderr[-3000:]
    assert json.loads(line[-1][5:]) == ["hvd.allreduce(name='loss')", "hvd.allgather", "hvd.broadcast(name='w')",
                                        "hvd.grouped_allreduce(name='g')", "hvd.broadcast_object(name='cfg')"]


def test_torch_backend_runs_the_same_codecs_as_the_numpy_reference():
    """hvdp.keras on the torch backend encodes with hvdp.torch's ops: same bytes as numpy."""
    code = ("import numpy as np, hvdp.keras as hvd; from hvdp import codecs; from hvdp.ops import NumpyOps\n"
            "from hvdp.keras.backend import BACKEND as B; import torch\n"
            "assert B.name == 'torch' and isinstance(B.ops, hvd.TorchOps)\n"
            "x = np.random.default_rng(5).standard_normal(4096).astype(np.float32)\n"
            "for n in ['fp16', 'bf16', 'int8', 'topk']:\n"
            "    c = codecs.get(n)\n"
            "    got = c.encode(B.ops, torch.from_numpy(x.copy())).numpy()\n"
            "    assert np.array_equal(got, c.encode(NumpyOps(), x)), n\n"
            "print('SAME')")
    r = _run(code, "torch")
    assert r.stdout.strip().endswith("SAME"), r.stderr[-3000:]


def test_tf_traced_step_with_nonfinite_result_rolls_back_the_residuals():
    """Inside tf.function the reducer cannot look at the data: the rollback of a non-finite
    step is a select assigned to the residual variables, the numpy reference's values."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "adapters", "keras"))
    from ops import TFOps

    from hvdp.reduce.simcomm import FakeGroup
    from hvdp.reduce.twophase import TwoPhaseReducer

    class VariableStore:  # as hvdp.keras keeps residuals on TensorFlow: assigned variables
        def __init__(self):
            self.vars = {}

        def create(self, name, n):
            self.vars[name] = tf.Variable(tf.zeros([n]), trainable=False)

        def get(self, name):
            return tf.convert_to_tensor(self.vars[name]) if name in self.vars else None

        def set(self, name, value):
            self.vars[name].assign(value)

        def snapshot(self):
            return {k: v.numpy() for k, v in self.vars.items()}

    class One:
        size, rank = 1, 0

    codec = codecs.get("topk", ratio=0.05)
    red = TwoPhaseReducer(codec, TFOps(), One(), True, worker_store=VariableStore(),
                          server_store=VariableStore())
    ref = TwoPhaseReducer(codec, NumpyOps(), FakeGroup(1).comms[0], True)
    c, padded = red.layout(1000)
    red.worker.create("b0", padded)
    red.server.create("b0", c)

    @tf.function
    def step(x):
        pend = red.start("b0", x)
        red.exchange(pend)
        return red.finish(pend)

    rng = np.random.default_rng(5)
    grads = [rng.standard_normal(1000).astype(np.float32) for _ in range(3)]
    grads[1] = grads[1] * np.float32(2.0 ** 20)
    grads[1][17] = np.inf
    for t, g in enumerate(grads):
        before = red.worker.snapshot()["b0"].copy()
        out = step(tf.constant(g)).numpy()
        pend = ref.start("b0", g.copy())
        ref.exchange(pend)
        np.testing.assert_array_equal(out, ref.finish(pend))
        np.testing.assert_array_equal(red.worker.snapshot()["b0"], ref.worker_residual["b0"])
        np.testing.assert_array_equal(red.server.snapshot()["b0"], ref.server_residual["b0"])
        if t == 1:
            assert not np.isfinite(out).all()
            np.testing.assert_array_equal(red.worker.snapshot()["b0"], before)
    assert step.experimental_get_tracing_count() == 1


def test_tf_eager_kernels_on_host_copies_with_an_in_memory_store():
    """TensorFlow's eager tensors with the kernels on host copies and the default in-memory
    residual store (auto's probe builds reducers so): the residuals are numpy arrays there, and
    a second step reads them back (a size check on them failed with TF's ops)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "adapters", "keras"))
    from ops import TFOps

    from hvdp.reduce.simcomm import FakeGroup
    from hvdp.reduce.twophase import TwoPhaseReducer

    class One:
        size, rank = 1, 0

    codec = codecs.get("int8")
    red = TwoPhaseReducer(codec, TFOps(), One(), True)
    ref = TwoPhaseReducer(codec, NumpyOps(), FakeGroup(1).comms[0], True)
    rng = np.random.default_rng(5)
    for _ in range(3):
        x = rng.standard_normal(3000).astype(np.float32)
        got = red.finish(red.start("b0", tf.constant(x)))
        want = ref.finish(ref.start("b0", x.copy()))
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_horovods_optimizer_and_callback_arguments_are_accepted_and_checked(backend):
    """Issue 27: device_dense / device_sparse / groups / num_groups / scale_local_gradients,
    register_local_var, BroadcastGlobalVariablesCallback(local_variables=), Horovod's elastic
    callbacks, and a Sequential without Input trained with the broadcast callback (one worker)."""
    code = r'''
import warnings, numpy as np, keras, hvdp.keras as hvd
from hvdp.keras.state import state_of
hvd.init()
def opt(**kw):
    return hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), **kw)
def raises(exc, fn):
    try:
        fn()
    except exc as e:
        return str(e)
    raise AssertionError(f"no {exc.__name__}")
t = lambda a: keras.ops.convert_to_tensor(np.asarray(a, "float32"))
opt(device_dense="/cpu:0", device_sparse="", scale_local_gradients=False)
raises(TypeError, lambda: opt(device_dense=0))
for bad in (0, -2, "two"):
    assert "groups" in raises(ValueError, lambda: opt(groups=bad))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    opt(num_groups=2)
assert any(issubclass(x.category, DeprecationWarning) for x in w), [str(x.message) for x in w]
a, b, c = (keras.Variable(np.ones(3, "float32"), name=n) for n in "abc")
grads = [t([1, 2, 3]), t([4, 5, 6]), t([7, 8, 9])]
o = opt(groups=[[a, b]])
o.apply(grads, [a, b, c])
assert state_of(o).engine.groups == ((a.path, b.path),), state_of(o).engine.groups
o = opt(groups=2)
o.apply(grads, [a, b, c])
assert state_of(o).engine.groups == ((a.path, b.path), (c.path,)), state_of(o).engine.groups
o = opt()
o.apply(grads, [a, b, c])
assert c.path in state_of(o).engine.names
o.register_local_var(c)  # after the first step: planned again without it
before = keras.ops.convert_to_numpy(c)
o.apply(grads, [a, b, c])
assert c.path not in state_of(o).engine.names and a.path in state_of(o).engine.names, state_of(o).engine.names
assert np.allclose(keras.ops.convert_to_numpy(c), before - np.array([7, 8, 9]) / hvd.size())
raises(TypeError, lambda: o.register_local_var(np.ones(3)))
cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=a)
assert list(cb._local) == [id(a)]
cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0, "", [a, b])
assert sorted(cb._local) == sorted([id(a), id(b)])
raises(ValueError, lambda: hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[np.ones(2)]))
for n in ("CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback"):
    assert issubclass(getattr(hvd.elastic, n), keras.callbacks.Callback), n
raises(ValueError, lambda: hvd.elastic.CommitStateCallback(None, batches_per_commit=0))
lazy = keras.Sequential([keras.layers.Dense(2)])
assert "built model" in raises(ValueError, lambda: hvd.elastic.KerasState(lazy, epoch=0))
model = keras.Sequential([keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])
model.compile(optimizer=opt(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x, y = np.random.rand(16, 3).astype("float32"), np.arange(16) % 2
model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
assert model.built and len(model.optimizer.variables) > 1
print("ACCEPTED")
'''
    r = _run(code, backend)
    assert r.stdout.strip().endswith("ACCEPTED"), r.stderr[-3000:]


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_one_state_object_per_distributed_optimizer(backend):
    """Issue 34: a distributed optimizer's settings and state are one OptimizerReducer, built with
    its groups and local variables, reached through state_of; a LossScaleOptimizer wrapped around
    it later (mixed_float16 set after the optimizer was made) shares it, reduces in its place and
    starts its own accumulation."""
    code = r'''
import numpy as np, keras, hvdp.keras as hvd
from hvdp.keras.reducer import OptimizerReducer
from hvdp.keras.state import state_of
hvd.init()
plain = keras.optimizers.SGD(0.1)
assert state_of(plain) is None and state_of(None) is None
opt = hvd.DistributedOptimizer(plain, backward_passes_per_step=2, average_aggregated_gradients=True, groups=1,
                               scale_local_gradients=False)
red = state_of(opt)
assert isinstance(red, OptimizerReducer) and red.backward_passes == 2 and red.average_aggregated
assert red.groups is not None and red.local.scale is False and red.outer is None
v = keras.Variable(np.ones(3, "float32"))
g = keras.ops.convert_to_tensor(np.full(3, 2.0, "float32"))
opt.apply([g], [v])
count = lambda: int(keras.ops.convert_to_numpy(red.count.read()))
assert len(red.accumulators) == 1 and count() == 1 and not red.reduced_elsewhere(opt)
assert red.engine.groups == ((v.path,),), red.engine.groups
lso = keras.optimizers.LossScaleOptimizer(opt)
assert state_of(lso) is red and red.outer is lso and red.accumulators == [] and red.count is None
assert red.reduced_elsewhere(opt) and not red.reduced_elsewhere(lso)
lso.apply([g], [v])
assert len(red.accumulators) == 1 and count() == 1  # the LossScaleOptimizer's own cycle
try:
    hvd.DistributedOptimizer(opt)
except ValueError as e:
    assert "already distributed" in str(e)
else:
    raise AssertionError("distributed twice")
print("ONE STATE")
'''
    r = _run(code, backend)
    assert r.stdout.strip().endswith("ONE STATE"), r.stderr[-3000:]


KERAS_ADAPTER = os.path.join(os.path.dirname(__file__), "..", "..", "adapters", "keras")


def test_keras_state_attribute_named_by_its_module_only_and_no_private_imports():
    """Issue 34: the attribute hvdp.keras keeps its state under is named in state.py only (every
    other module calls state_of), and no module imports another module's private name."""
    attribute = re.compile(r"""\._hvdp\b(?!_)|["']_hvdp["']""")
    hits = []
    for f in sorted(os.listdir(KERAS_ADAPTER)):
        if not f.endswith(".py"):
            continue
        with open(os.path.join(KERAS_ADAPTER, f), encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                if f != "state.py" and attribute.search(line):
                    hits.append(f"{f}:{i}: {line.strip()}")
                m = re.match(r"\s*from \.\w* import ([^#]+)", line)
                names = [n.strip(" ()").split(" as ")[0].strip() for n in m.group(1).split(",")] if m else []
                if any(n.startswith("_") for n in names):
                    hits.append(f"{f}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)


SWITCH_PROBE = """
import json
import tensorflow as tf
from hvdp.keras.backend import BACKEND as B
sw, traces, out = B.Switch(True, "probe"), [], []
off_first = tf.Variable(False)  # the eager call in the step turns the switch off first

@tf.function
def step(x):
    traces.append(1)  # Python runs at trace time only
    token = B.eager_call(lambda: sw.set(False) if bool(off_first.numpy()) else None)
    return sw.when(lambda: [x * 2.0], [x], token)[0]

for on, off in ((True, False), (False, False), (True, False), (True, True)):
    sw.set(on)
    off_first.assign(off)
    out.append(float(step(tf.constant(3.0))))
eager = []
for on in (True, False):
    sw.set(on)
    eager.append(float(sw.when(lambda: [tf.constant(3.0) * 2.0], [tf.constant(3.0)])[0]))
print(json.dumps({"out": out, "traces": len(traces), "eager": eager}))
"""


def test_tf_switch_decides_as_a_traced_step_runs():
    """hvd.OuterOptimizer's warm-up switch on TensorFlow: one trace, the branch chosen by the
    value set eagerly before each call (not the value at trace time), and read after the token
    of an ``eager_call`` in the same step that changes it."""
    r = _run(SWITCH_PROBE, "tensorflow")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"out": [6.0, 3.0, 6.0, 3.0], "traces": 1, "eager": [6.0, 3.0]}, got
