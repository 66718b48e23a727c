"""Checks of hvdp.keras under real workers; prints 'CHECK <name> OK rank=<r>' per passed check."""
import sys

import keras
import numpy as np
import tensorflow as tf

import hvdp.keras as hvd

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from reduction_bounds import check_reduced  # noqa: E402

# float32 through a few SGD steps; 2 workers and 1 worker sum the batch in different orders
TOL = 1e-5


def make_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((20,)), keras.layers.Dense(32, activation="tanh"),
                             keras.layers.Dense(3)])


def data(n, seed=1234):
    rs = np.random.RandomState(seed)
    return rs.randn(n, 20).astype("float32"), rs.randint(0, 3, n)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def allgathered(a, name):
    return hvd.allgather(tf.constant(np.asarray(a)[None]), name=name).numpy()


def assert_ranks_identical(model, tag):
    for i, w in enumerate(model.get_weights()):
        allw = allgathered(w, f"ident.{tag}.{i}")
        assert np.array_equal(allw[0], allw[-1]), f"weight {i} differs between ranks ({tag})"


def shard(x, y, per_worker, passes=1):
    """This rank's part of every global batch of passes * size * per_worker samples."""
    p, r = hvd.size(), hvd.rank()
    g = passes * p * per_worker
    idx = [u * g + j * p * per_worker + r * per_worker + k
           for u in range(len(x) // g) for j in range(passes) for k in range(per_worker)]
    return x[idx], y[idx]


def check_fit_equals_one_worker(passes=1, steps=5, b=8):
    x, y = data(steps * passes * hvd.size() * b)
    model, ref = make_model(), make_model()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                   backward_passes_per_step=passes, average_aggregated_gradients=True)
    model.compile(optimizer=opt, loss=LOSS)
    ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=LOSS)
    xs, ys = shard(x, y, b, passes)
    model.fit(xs, ys, batch_size=b, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    ref.fit(x, y, batch_size=passes * hvd.size() * b, epochs=1, shuffle=False, verbose=0)
    assert int(opt.iterations.numpy()) == steps, int(opt.iterations.numpy())
    for w, v in zip(model.get_weights(), ref.get_weights()):
        assert np.abs(w - v).max() <= TOL, np.abs(w - v).max()
    assert_ranks_identical(model, f"fit{passes}")


def check_broadcast_callback():
    model = make_model(seed=100 + hvd.rank())
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3)), loss=LOSS)
    before = allgathered(model.get_weights()[0], "bc.before")
    assert not np.array_equal(before[0], before[-1])
    cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
    cb.set_model(model)
    cb.on_train_begin()
    assert_ranks_identical(model, "bcast")


def check_metric_average():
    x, y = data(64, seed=hvd.rank())  # different data: different local losses
    seen = {}
    for cbs, tag in [([], "plain"), ([hvd.callbacks.MetricAverageCallback()], "avg")]:
        model = make_model()
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss=LOSS,
                      metrics=["accuracy"])
        h = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=cbs)
        seen[tag] = allgathered([h.history["loss"][-1], h.history["accuracy"][-1]], f"ma.{tag}")
    assert not np.allclose(seen["plain"][0], seen["plain"][-1])  # the callback has work to do
    assert np.array_equal(seen["avg"][0], seen["avg"][-1])
    np.testing.assert_allclose(seen["avg"][0], seen["plain"].mean(0), rtol=1e-6)


def check_warmup_curve():
    x, y = data(64)
    model = make_model()
    initial, warm, steps = 0.1, 2, 4
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(initial, momentum=0.9)), loss=LOSS)
    lrs = []
    rec = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda b, logs: lrs.append(
        float(np.asarray(model.optimizer.learning_rate))))
    model.fit(x[:steps * 16], y[:steps * 16], batch_size=16, epochs=3, verbose=0,
              callbacks=[hvd.callbacks.LearningRateWarmupCallback(initial, warmup_epochs=warm), rec])
    size = hvd.size()
    expect = [initial / size * ((e + b / steps) * (size - 1) / warm + 1) if e < warm else initial
              for e in range(3) for b in range(steps)]
    np.testing.assert_allclose(lrs, expect, rtol=1e-6)


def check_codecs():
    x, y = data(32 * hvd.size())
    xs, ys = shard(x, y, 32)
    for name in ["fp16", "bf16", "int8", "topk"]:
        for graph in (False, True):
            model = make_model(seed=7)
            variables = model.trainable_variables

            def local_and_reduced(xb, yb):
                with tf.GradientTape() as t1:
                    l1 = LOSS(yb, model(xb))
                local = t1.gradient(l1, variables)
                with tf.GradientTape() as t2:
                    l2 = LOSS(yb, model(xb))
                tape = hvd.DistributedGradientTape(t2, compression=name,
                                                   policy=hvd.CompressionPolicy(min_elements=1))
                return local, tape.gradient(l2, variables), tape

            fn = tf.function(local_and_reduced) if graph else local_and_reduced
            holder = {}
            if graph:
                def traced(xb, yb):
                    local, red, tape = local_and_reduced(xb, yb)
                    holder["tape"] = tape
                    return local, red
                local, red = tf.function(traced)(tf.constant(xs), tf.constant(ys))
                plan = holder["tape"]._hvdp.plan
            else:
                local, red, tape = fn(xs, ys)
                plan = tape._hvdp.plan
            everyone = [allgathered(tf.reshape(g, [-1]).numpy(), f"kc.{name}.{graph}.{i}")
                        for i, g in enumerate(local)]
            per_rank = [[e[r] for e in everyone] for r in range(hvd.size())]
            got = [tf.reshape(g, [-1]).numpy() for g in red]
            # a traced graph may turn x / c into x * (1/c) (Grappler): one ulp off the reference
            err = check_reduced(name, per_rank, got, plan.buckets, rtol_ref=2e-6 if graph else 1e-6)
            print(f"  {name} ({'graph' if graph else 'eager'}): max |err| vs exact average {err:.3g}",
                  flush=True)


def check_mixed_precision():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = data(64, seed=hvd.rank())
        model = make_model()
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), compression="int8",
                                       policy=hvd.CompressionPolicy(min_elements=1))
        assert isinstance(opt, keras.optimizers.LossScaleOptimizer)
        model.compile(optimizer=opt, loss=LOSS)
        h = model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                      callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        assert np.all(np.isfinite(h.history["loss"])) and h.history["loss"][-1] < h.history["loss"][0]
        assert_ranks_identical(model, "mp")
    finally:
        keras.mixed_precision.set_global_policy("float32")


def check_checkpoint_callback():
    import os
    import tempfile
    folder = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None, name="kck.dir")
    path = os.path.join(folder, "model.keras")
    x, y = data(32)
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss=LOSS)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0,
              callbacks=[hvd.callbacks.ModelCheckpoint(path)])
    hvd.allreduce(np.zeros(1), name="kck.barrier")
    if hvd.rank() == 0:
        assert os.listdir(folder) == ["model.keras"], os.listdir(folder)  # no temporary left
        restored = keras.models.load_model(path, compile=False)
        for a, b in zip(restored.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(a, b)


CHECKS = {
    "fit_equal": check_fit_equals_one_worker,
    "fit_bpps": lambda: check_fit_equals_one_worker(passes=2),
    "broadcast": check_broadcast_callback,
    "metric_average": check_metric_average,
    "warmup": check_warmup_curve,
    "codecs": check_codecs,
    "mixed_precision": check_mixed_precision,
    "checkpoint": check_checkpoint_callback,
}

if __name__ == "__main__":
    hvd.init()
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    for name in sys.argv[1:] or list(CHECKS):
        CHECKS[name]()
        print(f"CHECK {name} OK rank={hvd.rank()}", flush=True)
