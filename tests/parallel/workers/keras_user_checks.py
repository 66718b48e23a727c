"""What a demanding Keras user hits (issue 18), under real workers; prints 'CHECK <name> OK rank=<r>'."""
import os
import sys
import tempfile

import keras
import numpy as np
import tensorflow as tf

import hvdp.keras as hvd
from hvdp.keras.state import state_of
from horovod.tensorflow.compression import Compressor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from keras_checks import LOSS, allgathered, assert_ranks_identical, data, make_model  # noqa: E402
import cycle_check  # noqa: E402  (before hvd.init(): it reads the launcher's variable)

# the same float32 ops on the same data in the same order: a loaded copy trains exactly like the
# original; 0 would do, a few ulps leave room for a reordered kernel
TOL = 1e-6


def check_save_load():
    folder = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None, name="ksl.dir")
    path = os.path.join(folder, "model.keras")
    x, y = data(64)
    xs, ys = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss=LOSS)
    model.fit(xs, ys, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.ModelCheckpoint(path)])
    hvd.allreduce(np.zeros(1), name="ksl.barrier")
    stock = keras.models.load_model(path)  # stock Keras, with its optimizer state
    assert type(stock.optimizer) is keras.optimizers.SGD, type(stock.optimizer)
    saved = [v.numpy() for v in model.optimizer.variables]
    got = [v.numpy() for v in stock.optimizer.variables]
    assert len(got) == len(saved) and int(stock.optimizer.iterations.numpy()) == 4, \
        [v.path for v in stock.optimizer.variables]
    for a, b in zip(got, saved):
        np.testing.assert_array_equal(a, b)
    loaded = hvd.load_model(path)  # distributed again: trains on as the original does
    assert state_of(loaded.optimizer) is not None
    for m in (model, loaded):
        m.fit(xs, ys, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOL)
    assert_ranks_identical(loaded, "ksl")
    int8 = hvd.load_model(path, compression="int8")
    assert int8.optimizer.compression_stats()["codec"].startswith("int8"), int8.optimizer.compression_stats()
    # a user's optimizer class, registered with Keras: saved and loaded under its registered name
    mine = make_model()
    mine.compile(optimizer=hvd.DistributedOptimizer(MySGD(0.05, momentum=0.9)), loss=LOSS)
    mine.fit(xs, ys, batch_size=8, epochs=1, shuffle=False, verbose=0)
    own = os.path.join(tempfile.mkdtemp(), "mine.keras")  # every rank its own file
    mine.save(own)
    back = keras.models.load_model(own)
    assert type(back.optimizer) is MySGD, type(back.optimizer)
    for a, b in zip(back.optimizer.variables, mine.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@keras.saving.register_keras_serializable(package="hvdp_test")
class MySGD(keras.optimizers.SGD):
    pass


class Doubling(Compressor):
    """A user's Horovod compressor whose effect shows: float16 on the wire, doubled on the way back."""
    calls = 0

    @staticmethod
    def compress(tensor):
        Doubling.calls += 1
        return tf.cast(tensor, tf.float16), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tf.cast(tensor, ctx) * 2.0


def check_compressor():
    rng = np.random.RandomState(7 + hvd.rank())
    g = rng.randn(300).astype("float32")
    every = allgathered(g, "kco.g")
    # Horovod averages the float16 tensors in float16: the expected value within float16's precision
    want = 2.0 * every.astype(np.float16).astype(np.float32).mean(axis=0)
    v = keras.Variable(np.zeros(300, "float32"))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), compression=Doubling)
    opt.apply([tf.constant(g)], [v])
    np.testing.assert_allclose(-v.numpy(), want, rtol=2e-3, atol=2e-3)
    assert opt.compression_stats()["codec"] == "horovod:Doubling", opt.compression_stats()
    w = tf.Variable(tf.constant(g))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * w) / 2  # gradient: w = g
    got = hvd.DistributedGradientTape(tape, compression=Doubling).gradient(loss, [w])[0]
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-3, atol=2e-3)
    assert Doubling.calls >= 2, Doubling.calls


def check_module_collectives():
    """hvd.allreduce / grouped_allreduce with compression=hvd.Compression.fp16 or .none give
    horovod.tensorflow's bits (issue 27); a two-phase codec is a clear error on every rank."""
    import horovod.tensorflow as H
    t = tf.constant(np.random.RandomState(3 + hvd.rank()).randn(500).astype("float32") * 100)
    for ours, theirs in ((hvd.Compression.fp16, H.Compression.fp16), (hvd.Compression.none, H.Compression.none)):
        tag = f"kmc.{ours.name}"
        pairs = [(hvd.allreduce(t, name=f"{tag}.a", compression=ours),
                  H.allreduce(t, name=f"{tag}.ha", compression=theirs)),
                 *zip(hvd.grouped_allreduce([t, 2 * t], name=f"{tag}.g", compression=ours),
                      H.grouped_allreduce([t, 2 * t], name=f"{tag}.hg", compression=theirs))]
        for i, (a, b) in enumerate(pairs):
            assert a.dtype == b.dtype == tf.float32 and np.array_equal(a.numpy(), b.numpy()), (tag, i)
    exact = hvd.allreduce(t, name="kmc.exact").numpy()
    assert not np.array_equal(exact, hvd.allreduce(t, name="kmc.half", compression=hvd.Compression.fp16).numpy())
    try:
        hvd.allreduce(t, name="kmc.int8", compression=hvd.Compression.int8)
    except ValueError as e:
        assert "use hvd.Compression.fp16 or hvd.Compression.none" in str(e), e
    else:
        raise AssertionError("hvd.allreduce(compression=hvd.Compression.int8) ran")


def check_refreeze(passes=1):
    x, y = data(16 * passes * hvd.size() * 4)
    xs, ys = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    model = make_model()
    # min_elements=0: every tensor in an int8 bucket, so the layout holds all of them
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), compression="int8",
                                   policy=hvd.CompressionPolicy(min_elements=0),
                                   backward_passes_per_step=passes)
    first, head = model.layers

    def fit():
        model.compile(optimizer=opt, loss=LOSS)
        model.fit(xs, ys, batch_size=8, epochs=1, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

    def planned():
        return sum(state_of(opt).engine.numels[i] for idx in state_of(opt).plan.buckets for i in idx)

    fit()
    everything = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    assert planned() == everything, (planned(), everything)
    first.trainable = False  # freeze, recompile with the same optimizer
    frozen, head0 = first.get_weights(), head.get_weights()
    fit()
    assert all(np.array_equal(a, b) for a, b in zip(first.get_weights(), frozen)), "a frozen layer moved"
    assert not any(np.array_equal(a, b) for a, b in zip(head.get_weights(), head0)), "the head did not train"
    assert planned() == sum(int(np.prod(w.shape)) for w in head.weights), "buckets not re-planned"
    assert_ranks_identical(model, f"krf.frozen.{passes}")
    first.trainable = True  # and back
    fit()
    assert not any(np.array_equal(a, b) for a, b in zip(first.get_weights(), frozen)), "unfrozen did not train"
    assert planned() == everything
    assert_ranks_identical(model, f"krf.unfrozen.{passes}")


def _ranks_differ(value, tag):
    every = allgathered(keras.ops.convert_to_numpy(value), tag)
    return not np.array_equal(every[0], every[-1])


def check_local_vars():
    """opt.register_local_var (Horovod's semantics): a local variable's gradient is this worker's,
    divided by size (scale_local_gradients=True) or not; the others are averaged; eager, with
    backward_passes_per_step=2, and in model.fit with the broadcast callback leaving it alone."""
    p = hvd.size()
    rng = np.random.RandomState(11 + hvd.rank())
    gs, gl = rng.randn(6).astype("float32"), rng.randn(4).astype("float32")
    mean_s = allgathered(gs, "klv.gs").mean(axis=0)
    for scale, passes in ((True, 1), (False, 1), (True, 2)):
        vs, vl = keras.Variable(np.zeros(6, "float32"), name="s"), keras.Variable(np.zeros(4, "float32"), name="l")
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), scale_local_gradients=scale,
                                       backward_passes_per_step=passes)
        opt.register_local_var(vl)
        for _ in range(passes):
            opt.apply([tf.constant(gs), tf.constant(gl)], [vs, vl])
        assert vl.path not in state_of(opt).engine.names, state_of(opt).engine.names
        np.testing.assert_allclose(-vs.numpy(), passes * mean_s, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(-vl.numpy(), passes * gl / (p if scale else 1), rtol=1e-6, atol=1e-6)
    # in fit, on different data per rank: the local bias differs between ranks, the rest is identical
    x, y = data(64)
    model = make_model(seed=30 + hvd.rank())
    bias = model.layers[0].bias
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), compression="int8",
                                   policy=hvd.CompressionPolicy(min_elements=0))
    opt.register_local_var(bias)
    model.compile(optimizer=opt, loss=LOSS)
    model.fit(x[hvd.rank()::p], y[hvd.rank()::p], batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[bias])])
    assert _ranks_differ(bias, "klv.bias"), "the local bias was averaged"
    for i, v in enumerate(model.trainable_variables):
        if v is not bias:
            assert not _ranks_differ(v, f"klv.w{i}"), v.path


def check_broadcast_local():
    """BroadcastGlobalVariablesCallback(root, local_variables=...): those keep each rank's value."""
    model = make_model(seed=50 + hvd.rank())
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=LOSS)
    kernel = model.layers[0].kernel
    for local in (kernel, [kernel]):
        cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=local)
        cb.set_model(model)
        cb.on_train_begin()
        assert cb.broadcast_done and _ranks_differ(kernel, "kbl.kernel"), "a local variable was broadcast"
        for i, v in enumerate(model.variables):
            if v is not kernel:
                assert not _ranks_differ(v, f"kbl.{i}"), v.path
    cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
    cb.set_model(model)
    cb.on_train_begin()
    assert not _ranks_differ(kernel, "kbl.all")


def check_lazy_model():
    """A Sequential without Input (Horovod's TF2 Keras example): fit builds it on the first batch;
    the broadcast callback then broadcasts at that batch's end; ranks identical after fit."""
    keras.utils.set_random_seed(70 + hvd.rank())
    model = keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3)), loss=LOSS)
    x, y = data(64)
    model.fit(x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()], batch_size=8, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert_ranks_identical(model, "klz")


class _Probe(keras.callbacks.Callback):
    def __init__(self, state):
        super().__init__()
        self.state, self.steps, self.batches = state, [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.steps.append(self.params["steps"])

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(self.state.batch)


def check_elastic_callbacks():
    """hvd.elastic.CommitStateCallback / UpdateBatchStateCallback / UpdateEpochStateCallback with
    KerasState, Horovod's behaviour: commits every n batches and at each epoch's end (restore()
    goes back to the last), state.batch and state.epoch kept, a resumed epoch reported shorter."""
    x, y = data(64)
    xs, ys = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]  # 32: 4 batches of 8
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss=LOSS)
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)  # Horovod's form: the compiled optimizer
    assert state.optimizer is model.optimizer
    commits = []
    plain_commit = state.commit
    state.commit = lambda: (commits.append((state.epoch, state.batch)), plain_commit())[1]
    probe = _Probe(state)
    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=3),
                 hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state), probe]
    model.fit(xs, ys, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    # CommitState runs first: at batch 2 it commits before UpdateBatchState records the batch
    assert commits == [(0, 1), (0, 3), (1, 0), (1, 3)], commits
    assert (state.epoch, state.batch) == (2, 0) and probe.batches == [0, 1, 2, 3] * 2, (state.epoch, probe.batches)
    assert probe.steps == [4, 4], probe.steps
    trained = [w.copy() for w in model.get_weights()]
    model.set_weights([w + 1 for w in trained])
    state.restore()  # the last commit: the last epoch's end, before UpdateEpochState counted it
    for a, b in zip(model.get_weights(), trained):
        np.testing.assert_array_equal(a, b)
    assert (state.epoch, state.batch) == (1, 3), (state.epoch, state.batch)
    state.batch = 2  # as after a reset in the middle of an epoch
    del probe.steps[:], probe.batches[:]
    model.fit(xs, ys, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    assert probe.steps == [2, 4] and state.epoch == 3, (probe.steps, state.epoch)
    assert probe.batches == [0, 1, 2, 3] * 2, probe.batches  # Keras 3 runs every step all the same
    assert_ranks_identical(model, "kec")


def check_elastic_restore_after_sync():
    """KerasState.sync() then restore() (a failure right after a reset): every rank goes back to
    the synced state, rank 0's, as in Horovod (it saves after its broadcast), attributes too."""
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss=LOSS)
    model.set_weights([w + hvd.rank() for w in model.get_weights()])  # the ranks differ
    state = hvd.elastic.KerasState(model, epoch=10 + hvd.rank())
    state.sync()
    synced = [w.copy() for w in model.get_weights()]
    assert not _ranks_differ(synced[0], "kers.synced") and state.epoch == 10, state.epoch
    model.set_weights([w + 7 for w in synced])
    state.epoch = 5
    state.restore()
    for a, b in zip(model.get_weights(), synced):
        np.testing.assert_array_equal(a, b)
    assert state.epoch == 10, state.epoch
    x, y = data(16)
    model.fit(x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()], batch_size=8, epochs=1, verbose=0)
    assert_ranks_identical(model, "kers.trained")


def check_recreated_optimizers_are_freed(n=10):
    """Issue 26: a model + int8 optimizer re-created per fold (10 times, one fit each) leaves no
    optimizer alive after a collection: nothing of hvdp's (reducer, registries, callbacks, the
    stall watchdog's last look at a traced step) keeps a dropped one. Until the watchdog kept call
    tokens instead of frames, one or two stayed alive now and then on a loaded machine."""
    import gc
    import weakref
    x, y = data(16)
    refs = []
    for _ in range(n):
        model = make_model()
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), compression="int8")
        model.compile(optimizer=opt, loss=LOSS)
        model.fit(x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()], batch_size=8, epochs=1, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        refs.append(weakref.ref(opt))
        del model, opt
    gc.collect()
    alive = sum(r() is not None for r in refs)
    print(f"KERAS_RECREATED alive {alive}/{n}", flush=True)
    assert alive == 0, f"{alive} of {n} dropped hvdp.keras optimizers are still alive"


CHECKS = {
    "cycle_time": lambda: cycle_check.check(bool(tf.config.list_physical_devices("GPU"))),
    "save_load": check_save_load,
    "compressor": check_compressor,
    "refreeze": lambda: (check_refreeze(), check_refreeze(passes=2)),  # one job: CI time
    "module_collectives": check_module_collectives,
    "local_vars": check_local_vars,
    "broadcast_local": check_broadcast_local,
    "lazy_model": check_lazy_model,
    "elastic_callbacks": check_elastic_callbacks,
    "elastic_restore_after_sync": check_elastic_restore_after_sync,
    "freed": check_recreated_optimizers_are_freed,
}

if __name__ == "__main__":
    hvd.init()
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    for name in sys.argv[1:] or list(CHECKS):
        CHECKS[name]()
        print(f"CHECK {name} OK rank={hvd.rank()}", flush=True)
