"""hvdp.keras on Keras' TensorFlow backend: horovod.tensorflow's collectives, TF array ops,
residuals and accumulators in ``tf.Variable`` (they must survive across traced train steps)."""
import functools
import os

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from horovod.common.elastic import run_fn
from horovod.common.exceptions import HorovodInternalError

from hvdp.cluster.flight import RECORDER as FLIGHT
from hvdp.cluster.reports import collective_failed
from hvdp.cluster.watchdog import calls_inside

from .comm import TFCollectives, op_name
from .ops import TFOps
from .xla import refuse_xla


class VariableStore:
    """Residuals kept in tf.Variables, so error feedback survives across traced steps."""

    def __init__(self, prefix):
        self.prefix, self.vars = prefix, {}

    def create(self, name, n):
        """A zero residual of n elements; one of another size (a new layout) is replaced."""
        v = self.vars.get(name)
        if v is None or v.shape.num_elements() != n:
            self.vars[name] = tf.Variable(tf.zeros([n]), trainable=False,
                                          name=op_name(f"{self.prefix}_{name}"))

    def get(self, name):
        v = self.vars.get(name)
        return None if v is None else tf.convert_to_tensor(v)

    def set(self, name, value):
        self.vars[name].assign(value)

    def snapshot(self):
        return {k: v.numpy() for k, v in self.vars.items()}

    def restore(self, data):
        """Residuals from ``data`` where present and of the right size; zero otherwise."""
        for k, var in self.vars.items():
            v = data.get(k)
            ok = v is not None and var.shape.num_elements() == np.size(v)
            var.assign(v if ok else tf.zeros_like(var))


class Buffer:
    """A local accumulator (``backward_passes_per_step``), updated inside traced steps."""

    def __init__(self, shape, dtype="float32"):
        with tf.init_scope():
            self.var = tf.Variable(tf.zeros(shape, tf.as_dtype(dtype)), trainable=False)

    def add(self, x):
        self.var.assign_add(tf.cast(tf.convert_to_tensor(x), self.var.dtype))

    def read(self):
        return tf.convert_to_tensor(self.var)

    def reset(self):
        self.var.assign(tf.zeros_like(self.var))


class Switch:
    """A yes/no that the eager part of a step sets (``set``) and that a traced step reads when it
    runs, not when it is traced: a bool ``tf.Variable`` on the host, read by a ``tf.cond``. Only
    the branch taken runs, so its collectives run only on the steps that need them."""

    def __init__(self, on, name):
        with tf.init_scope(), tf.device("/cpu:0"):
            self.var = tf.Variable(bool(on), trainable=False, name=name)

    def set(self, on):
        self.var.assign(bool(on))

    def when(self, fn, otherwise, token=None):
        """``fn()`` where the switch is on as this runs, else ``otherwise`` (the structure that
        ``fn()`` returns). Traced: the switch is read after ``token`` (an ``eager_call``'s)."""
        if tf.executing_eagerly():
            return fn() if bool(self.var.numpy()) else otherwise
        with tf.control_dependencies([] if token is None else [token]):
            on = self.var.read_value()
        return tf.cond(on, fn, lambda: otherwise)


_ONE = {}
_WATCH = {}


def _watch_counters(dog, name):
    """The step's counts of waits begun and ended (host variables, made once), read by ``dog``."""
    if "v" not in _WATCH:
        with tf.init_scope(), tf.device("/cpu:0"):
            _WATCH["v"] = (tf.Variable(0, dtype=tf.int64, trainable=False, name="hvdp_waits_begun"),
                           tf.Variable(0, dtype=tf.int64, trainable=False, name="hvdp_waits_ended"))
        begun, ended = _WATCH["v"]
        dog.poll(name, lambda: (int(begun.numpy()), int(ended.numpy()), _tf_calls()))
        # the flight record counts them too: a traced step's reductions are in no Python call
        FLIGHT.count_outside("hvdp.keras.traced_step", lambda: (int(begun.numpy()), int(ended.numpy())))
    return _WATCH["v"]


_TF_DIR = os.sep + "tensorflow" + os.sep


def _tf_calls():
    """The calls of the other threads that are inside TensorFlow, such as a traced step's call:
    a stalled collective keeps its thread in one same call, while a step that failed has
    returned (a count it began then never ends)."""
    return calls_inside(_TF_DIR)


def _settle_watch():
    """A failed step's wait will not end: count it as ended (an elastic reset goes on)."""
    if "v" in _WATCH:
        begun, ended = _WATCH["v"]
        ended.assign(begun)


class TFBackend:
    name = "tensorflow"
    hvd = hvd
    ops = TFOps()
    Collectives = TFCollectives
    Store = VariableStore
    Buffer = Buffer
    Switch = Switch
    init_scope = staticmethod(tf.init_scope)
    refuse_xla = staticmethod(refuse_xla)
    op_name = staticmethod(op_name)
    eager_steps = False  # the train step is traced: auto chooses one codec, before tracing
    tensor_types = (tf.Tensor, tf.Variable)  # what horovod.tensorflow's compressors take

    @staticmethod
    def uses_gpu():
        """Whether TensorFlow sees a GPU (Horovod's cycle time: ``hvdp.cluster.cycle``)."""
        return bool(tf.config.list_physical_devices("GPU"))

    @staticmethod
    def collective_input(x):
        """What horovod.tensorflow.keras makes of a collective's value: ``tf.constant(value)``
        (numpy arrays, Python numbers and lists; a Keras variable by its value)."""
        if isinstance(x, (tf.Tensor, tf.Variable)):
            return x
        return tf.convert_to_tensor(x.value) if hasattr(x, "path") and hasattr(x, "value") else tf.constant(x)

    @staticmethod
    def tracing():
        return not tf.executing_eagerly()

    @staticmethod
    def watch(dog, name, grads, fn):
        """``fn(grads)`` (a list of gradients -> a list) with its collectives under the stall
        watchdog ``dog``. They wait inside TensorFlow's executor, not in a Python call, so the
        step counts the waits it begins and ends in two host variables (before any collective
        starts: the gradients depend on it; after every result is there: they depend on it),
        and the watchdog's thread reads them (``StallWatchdog.poll``)."""
        if dog.timeout_s <= 0:
            return fn(grads)
        begun, ended = _watch_counters(dog, name)
        with tf.control_dependencies([begun.assign_add(1)]):
            grads = [g if g is None else tf.identity(g) for g in grads]
        out = fn(grads)
        with tf.control_dependencies([t for t in tf.nest.flatten(out, expand_composites=True) if t is not None]):
            done = ended.assign_add(1)
        with tf.control_dependencies([done]):
            return [o if o is None else tf.identity(o) for o in out]

    @staticmethod
    def is_sparse(g):
        return isinstance(g, tf.IndexedSlices)

    @staticmethod
    def dense(g):
        return tf.convert_to_tensor(g)

    @staticmethod
    def allgather_np(arr, name, process_set=hvd.global_process_set):
        """numpy in, every rank's rows out (numpy); eager even while a step is traced."""
        with tf.init_scope():
            return hvd.allgather(tf.constant(np.asarray(arr)), name=name, process_set=process_set).numpy()

    @staticmethod
    def allreduce_np(arr, name, average=True):
        with tf.init_scope():
            return hvd.allreduce(tf.constant(np.asarray(arr)), name=name,
                                 op=hvd.Average if average else hvd.Sum).numpy()

    @staticmethod
    def broadcast_variables(variables, names, root_rank, process_set):
        for i, (v, name) in enumerate(zip(variables, names)):
            v.assign(hvd.broadcast(tf.convert_to_tensor(v), root_rank, name=op_name(f"hvdp.bcast.{i}.{name}"),
                                   process_set=process_set))

    @staticmethod
    def eager_call(fn, after=()):
        """``fn()`` run eagerly in Python at this point of every step, at once or, inside a traced
        step, as a ``tf.py_function`` that reads the variables ``after`` first (so it runs after
        every assignment to them that comes before it in the step). -> a token (traced) or None."""
        if tf.executing_eagerly():
            fn()
            return None

        def run(*_):
            fn()
            return tf.constant(0)
        return tf.py_function(run, [tf.convert_to_tensor(v) for v in after], tf.int32)

    @staticmethod
    def run_after(token, fn):
        """``fn()``, its ops run after ``token`` (an ``eager_call``'s) where the step is traced."""
        if token is None:
            return fn()
        with tf.control_dependencies([token]):
            return fn()

    @staticmethod
    def one():
        """A 1 read from a variable: Horovod's allreduce op is not marked stateful, so TF's graph
        optimizer would fold an allreduce of a constant into the value of its first run."""
        if "v" not in _ONE:
            with tf.init_scope():
                _ONE["v"] = tf.Variable([1.0], trainable=False, name="hvdp_join_one")
        return tf.convert_to_tensor(_ONE["v"])

    @staticmethod
    def horovod_join() -> int:
        """Horovod's join op, run in a new ``tf.function`` each time: the op has no input and is not
        marked stateful, so TF reuses the result of the first eager call and a second ``join``
        (the next epoch) would return at once, measured here with TF 2.21."""
        return int(tf.function(lambda: hvd.join())())

    @staticmethod
    def allreduce_differentiable(x, name, process_set=hvd.global_process_set):
        """Sum over the workers, with Horovod's gradient (the sum of the upstream gradients)."""
        return hvd.allreduce(x, op=hvd.Sum, name=op_name(name), process_set=process_set)

    @staticmethod
    def elastic_run(func):
        """Horovod's elastic ``run`` for TF. Horovod 0.28.1's TF version turns a failed collective
        into a reset only when the TF error names HorovodAllreduce, HorovodAllgather or
        HorovodBroadcast, and otherwise swallows the error and returns as if training had
        finished. hvdp's ops are named hvdp.* and its two-phase codecs use HorovodAlltoall, and a
        peer killed mid-collective can surface as Gloo's bare transport error; so here every
        failed Horovod op resets (``collective_failed``), and any other error propagates."""
        @functools.wraps(func)
        def wrapper(state, *args, **kwargs):
            try:
                return func(state, *args, **kwargs)
            except tf.errors.OpError as e:
                _settle_watch()
                if collective_failed(e.message):
                    raise HorovodInternalError(e) from e
                raise

        def reset():
            hvd.shutdown()
            hvd.init()
        return run_fn(wrapper, reset)


BACKEND = TFBackend()
