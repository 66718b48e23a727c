"""The probes of test_keras_adapter.py (their code: PROBES; their assertions: there) and their
runner, run under a given KERAS_BACKEND: several probes of hvdp.keras in one process, so that the
backend starts once for all of them (a TensorFlow start is most of each probe's time). Standard
input: a JSON list of [name, code or a .py file's path], run in that order (each in a fresh
namespace, as ``__main__``; an earlier probe's imports and ``hvd.init()`` stay). Standard output's
last line: JSON {name: {"rc": 0 or 1, "stdout": ..., "stderr": ...}}, where stderr holds the
traceback of a probe that raised."""
import contextlib
import io
import json
import os
import runpy
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


COMPRESSOR_PROBE = (
    "import numpy as np, hvdp.keras as hvd\n"
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


WATCHDOG_PROBE = r'''
import contextlib, json, numpy as np, hvdp.keras as hvd
from hvdp.keras.agreement import WATCHDOG
seen = []
@contextlib.contextmanager
def waiting(name):
    seen.append(name)
    yield
x = np.ones(2, 'float32')
WATCHDOG.waiting = waiting
try:
    for call in (lambda: hvd.allreduce(x, 'loss'), lambda: hvd.allgather(x),
                 lambda: hvd.broadcast(x, 0, 'w'), lambda: hvd.grouped_allreduce([x], name='g'),
                 lambda: hvd.broadcast_object(1, 0, name='cfg')):
        try:
            call()
        except Exception as e:
            assert 'not been initialized' in str(e) or 'not initialized' in str(e), repr(e)
    if hvd._B.name == 'tensorflow':
        import tensorflow as tf
        try:  # traced: not a wait (Horovod may refuse while the op is built)
            tf.function(lambda t: hvd.allreduce(t, name='traced')).get_concrete_function(tf.TensorSpec([2]))
        except ValueError as e:
            assert 'not been initialized' in str(e), repr(e)
finally:  # the probes after this one in the same process see the watchdog's own
    del WATCHDOG.waiting
print('SEEN', json.dumps(seen))
'''


TORCH_CODECS_PROBE = (
    "import numpy as np, hvdp.keras as hvd; from hvdp import codecs; from hvdp.ops import NumpyOps\n"
    "from hvdp.keras.backend import BACKEND as B; import torch\n"
    "assert B.name == 'torch' and isinstance(B.ops, hvd.TorchOps)\n"
    "x = np.random.default_rng(5).standard_normal(4096).astype(np.float32)\n"
    "for n in ['fp16', 'bf16', 'int8', 'topk']:\n"
    "    c = codecs.get(n)\n"
    "    got = c.encode(B.ops, torch.from_numpy(x.copy())).numpy()\n"
    "    assert np.array_equal(got, c.encode(NumpyOps(), x)), n\n"
    "print('SAME')")


ARGS_PROBE = r'''
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


STATE_PROBE = r'''
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

BOTH, TF_ONLY, TORCH_ONLY = ("tensorflow", "torch"), ("tensorflow",), ("torch",)
# (name, code or file, backends), run in this order in one process per backend: the watchdog's
# probe wants Horovod not initialized; the last two call hvd.init()
PROBES = [
    ("watchdog", WATCHDOG_PROBE, BOTH),
    ("compressor", COMPRESSOR_PROBE, BOTH),
    ("names", os.path.join(HERE, "keras_names_probe.py"), BOTH),
    ("torch_codecs", TORCH_CODECS_PROBE, TORCH_ONLY),
    ("switch", SWITCH_PROBE, TF_ONLY),
    ("args", ARGS_PROBE, BOTH),
    ("state", STATE_PROBE, BOTH),
]


def run(probes):
    results = {}
    for name, code in probes:
        out, err = io.StringIO(), io.StringIO()
        rc = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if code.endswith(".py"):
                    runpy.run_path(code, run_name="__main__")
                else:
                    exec(compile(code, f"<probe {name}>", "exec"), {"__name__": "__main__"})
            except BaseException:  # noqa: BLE001 - a probe's failure (SystemExit included) is its result
                rc = 1
                traceback.print_exc()
        results[name] = {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}
    return results


if __name__ == "__main__":
    print(json.dumps(run(json.load(sys.stdin))))
