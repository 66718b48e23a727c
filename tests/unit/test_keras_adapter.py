"""The Keras adapter without processes: TF ops vs the numpy reference; unsupported set-ups;
Horovod's names reachable on both backends.
The checks that need a backend of their own run as probes in one process per backend: their code is
in tests/unit/keras_probes.py (PROBES), their assertions here."""
import functools
import json
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from hvdp import codecs  # noqa: E402
from hvdp.ops import NumpyOps  # noqa: E402
from unit import keras_probes  # noqa: E402


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


def _run(code_or_file, backend, timeout=240, stdin=None):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1")
    args = [code_or_file] if code_or_file.endswith(".py") else ["-c", code_or_file]
    return subprocess.run([sys.executable] + args, capture_output=True, text=True, env=env, timeout=timeout,
                          input=stdin)



def _probe(name, backend):
    """One probe's result from the one process per backend that runs them all (keras_probes.PROBES,
    in order): .returncode, .stdout, .stderr as a process of its own."""
    got = _probed(backend)
    if name not in got:  # the process itself failed: its output, for every probe
        return types.SimpleNamespace(returncode=1, stdout="", stderr=got[None])
    r = got[name]
    return types.SimpleNamespace(returncode=r["rc"], stdout=r["stdout"], stderr=r["stderr"])


@functools.lru_cache(maxsize=None)
def _probed(backend):
    probes = [[name, code] for name, code, backends in keras_probes.PROBES if backend in backends]
    r = _run(keras_probes.__file__, backend, timeout=480, stdin=json.dumps(probes))
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {None: f"keras_probes.py ended with {r.returncode}:\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}"}


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
    r = _probe("names", backend)
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
    r = _probe("compressor", backend)
    assert r.stdout.strip().endswith("SAME " + ("3" if backend == "tensorflow" else "1")), r.stderr[-3000:]


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_module_collectives_are_under_the_stall_watchdog(backend):
    """hvd.allreduce & co. as hvdp.keras exports them: each eager call a wait of the stall
    watchdog named after the collective and its name argument (Horovod refuses, not initialized);
    a call while a graph is traced is not one."""
    r = _probe("watchdog", backend)
    line = [s for s in r.stdout.splitlines() if s.startswith("SEEN ")]
    assert line, r.stderr[-3000:]
    assert json.loads(line[-1][5:]) == ["hvd.allreduce(name='loss')", "hvd.allgather", "hvd.broadcast(name='w')",
                                        "hvd.grouped_allreduce(name='g')", "hvd.broadcast_object(name='cfg')"]


def test_torch_backend_runs_the_same_codecs_as_the_numpy_reference():
    """hvdp.keras on the torch backend encodes with hvdp.torch's ops: same bytes as numpy."""
    r = _probe("torch_codecs", "torch")
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
    r = _probe("args", backend)
    assert r.stdout.strip().endswith("ACCEPTED"), r.stderr[-3000:]


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_one_state_object_per_distributed_optimizer(backend):
    """Issue 34: a distributed optimizer's settings and state are one OptimizerReducer, built with
    its groups and local variables, reached through state_of; a LossScaleOptimizer wrapped around
    it later (mixed_float16 set after the optimizer was made) shares it, reduces in its place and
    starts its own accumulation."""
    r = _probe("state", backend)
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


def test_tf_switch_decides_as_a_traced_step_runs():
    """hvd.OuterOptimizer's warm-up switch on TensorFlow: one trace, the branch chosen by the
    value set eagerly before each call (not the value at trace time), and read after the token
    of an ``eager_call`` in the same step that changes it."""
    r = _probe("switch", "tensorflow")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"out": [6.0, 3.0, 6.0, 3.0], "traces": 1, "eager": [6.0, 3.0]}, got
