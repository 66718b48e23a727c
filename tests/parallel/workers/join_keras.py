"""hvdp.keras with uneven inputs: rank r runs ``steps[r]`` steps, then ``hvd.join()``.

Usage: join_keras.py STEPS MODE:CODEC[,CODEC...] [MODE:CODEC[,...] ...]  (the groups run in turn)
  MODE loop:    a custom tf.function loop + hvd.join(), against the replayed reference; the
                optimizer made as in a Horovod script, without uneven_inputs (the default)
  MODE loopin:  the same with an explicit uneven_inputs=True
  MODE fit:     model.fit on shards of different lengths with hvd.callbacks.JoinCallback (default
                uneven_inputs)
  MODE nojoin:  model.fit on such shards without it: the clear error on every rank
  MODE refuse:  the custom loop with uneven_inputs=False: JoinRefused on the rank that joins first
Prints 'CHECK join-<mode>-<codec> OK rank=<r> ...' per codec.
"""
import sys

import keras
import numpy as np

import hvdp.keras as hvd
from hvdp.keras.state import state_of

if keras.backend.backend() == "tensorflow":  # the loop modes are TF's; fit runs on both backends
    import tensorflow as tf
else:
    import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from join_reference import check_uneven_run  # noqa: E402

LR = 0.1
DEFAULT = object()  # make the optimizer without the uneven_inputs argument
B = 8
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="tanh"),
                             keras.layers.Dense(3)])


def shard(n_steps, rank):
    rs = np.random.RandomState(1000 + rank)
    return rs.randn(n_steps * B, 20).astype("float32"), rs.randint(0, 3, n_steps * B)


def allgathered(a, name):
    a = np.ascontiguousarray(np.asarray(a)[None])
    t = tf.constant(a) if keras.backend.backend() == "tensorflow" else torch.from_numpy(a)
    return keras.ops.convert_to_numpy(hvd.allgather(t, name=name))


def assert_identical(model, opt, tag):
    for i, w in enumerate(model.get_weights() + [keras.ops.convert_to_numpy(opt.iterations)]):
        every = allgathered(w, f"join.ident.{tag}.{i}")
        assert all(np.array_equal(every[0], e) for e in every), f"{tag}: variable {i} differs"


def residuals(opt):
    state = state_of(opt).residual_state()
    if state is None or not state["worker"]:
        return None
    return {k: {b: np.array(v) for b, v in state[k].items()} for k in ("worker", "server")}


def run_loop(codec, steps, uneven_inputs=DEFAULT):
    rank, size = hvd.rank(), hvd.size()
    model = make_model()
    p0 = [w.copy() for w in model.get_weights()]
    kw = {} if uneven_inputs is DEFAULT else dict(uneven_inputs=uneven_inputs)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR), compression=codec, **kw)
    variables = model.trainable_variables

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = LOSS(yb, model(xb, training=True))
        grads = tape.gradient(loss, variables)
        opt.apply(grads, variables)
        return grads

    x, y = shard(steps[rank], rank)
    local, res_after = [], []
    for t in range(steps[rank]):
        local.append([g.numpy().copy() for g in step(x[t * B:(t + 1) * B], y[t * B:(t + 1) * B])])
        res_after.append(residuals(opt))
    last = hvd.join()
    if uneven_inputs is not False:  # the default resolved to the join control, as True does
        assert state_of(opt).engine.settings.uneven_inputs is True, state_of(opt).engine.settings
    assert last == int(np.argmax(steps)), (last, steps)
    assert_identical(model, opt, f"loop.{codec}")
    iterations = int(keras.ops.convert_to_numpy(opt.iterations))
    assert iterations == max(steps), iterations

    res = residuals(opt)
    if res is not None:
        for b in res["worker"]:
            if steps[rank] < max(steps):
                np.testing.assert_array_equal(res["worker"][b], res_after[-1]["worker"][b])
            else:
                assert not np.any(res["worker"][b]), f"{codec}: worker residual not flushed"
            np.testing.assert_array_equal(res["server"][b], res_after[min(steps) - 1]["server"][b])

    every_local = hvd.allgather_object(local, name=f"join.local.{codec}")
    every_res = hvd.allgather_object(res, name=f"join.res.{codec}") if res is not None else None
    final = model.get_weights()
    err, bound = check_uneven_run(codec, every_local, steps, size, p0, final, LR, every_res,
                                  [tuple(idx) for idx in state_of(opt).plan.buckets])
    how = "default" if uneven_inputs is DEFAULT else uneven_inputs
    print(f"CHECK join-loop-{codec} OK rank={rank} uneven_inputs={how} err={err:.3g} bound={bound:.3g}",
          flush=True)


def run_fit(codec, steps, with_join=True, epochs=2):
    rank = hvd.rank()
    model = make_model()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9), compression=codec)
    model.compile(optimizer=opt, loss=LOSS)
    x, y = shard(steps[rank], rank)
    # JoinCallback last: it joins after the last batch, before MetricAverageCallback's allreduce
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()] + (
        [hvd.callbacks.JoinCallback()] if with_join else [])
    hist = model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks,
                     validation_data=(x[:B], y[:B]))
    assert_identical(model, opt, f"fit.{codec}")
    iterations = int(keras.ops.convert_to_numpy(opt.iterations))
    assert iterations == epochs * max(steps), iterations
    assert np.all(np.isfinite(hist.history["loss"]))
    print(f"CHECK join-fit-{codec} OK rank={rank} iterations={iterations}", flush=True)


def run_nojoin(codec, steps):
    try:
        run_fit(codec, steps, with_join=False)
    except ValueError as e:
        assert f"steps_per_epoch={min(steps)}" in str(e) and "JoinCallback" in str(e), str(e)
        print(f"CHECK join-nojoin-{codec} OK rank={hvd.rank()}: {e}", flush=True)
        return
    raise AssertionError("uneven fit without JoinCallback was not refused")


def run_refuse(codec, steps):
    try:
        run_loop(codec, steps, uneven_inputs=False)
    except hvd.JoinRefused as e:
        print(f"REFUSED rank={hvd.rank()}: {e}", flush=True)
        raise


if __name__ == "__main__":
    hvd.init()
    steps = [int(s) for s in sys.argv[1].split(",")]
    assert len(steps) == hvd.size(), (steps, hvd.size())
    modes = {"loop": run_loop, "loopin": lambda c, s: run_loop(c, s, uneven_inputs=True), "fit": run_fit,
             "nojoin": run_nojoin, "refuse": run_refuse}
    for group in sys.argv[2:]:  # "mode:codec,codec,...", in turn in one job (each joins, then goes on)
        mode, _, names = group.partition(":")
        for name in names.split(","):
            modes[mode](name, steps)
