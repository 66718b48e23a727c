"""Checks of hvdp.keras's hvd.OuterOptimizer (outer steps) under real workers, on the Keras backend
KERAS_BACKEND names; prints 'CHECK <name> OK rank=<r>' per passed check."""
import sys

import keras
import numpy as np

import hvdp.keras as hvd
from hvdp.keras.state import outer_of

TF = keras.backend.backend() == "tensorflow"
if TF:
    import tensorflow as tf
else:
    import torch

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
PER_WORKER, STEPS = 8, 12


def make_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((20,)), keras.layers.Dense(32, activation="tanh"),
                             keras.layers.Dense(3)])


def my_data(steps=STEPS, rank=None):
    """This rank's (or ``rank``'s) slice of every global batch (the same global batches for every run)."""
    rank = hvd.rank() if rank is None else rank
    rs = np.random.RandomState(1234)
    x, y = rs.randn(steps * 2 * PER_WORKER, 20).astype("float32"), rs.randint(0, 3, steps * 2 * PER_WORKER)
    idx = [s * 2 * PER_WORKER + rank * PER_WORKER + k for s in range(steps) for k in range(PER_WORKER)]
    return x[idx], y[idx]


def tensor(a):
    a = np.ascontiguousarray(a)
    return tf.constant(a) if TF else torch.from_numpy(a)


def assert_ranks_identical(model, tag):
    for i, w in enumerate(model.get_weights()):
        every = keras.ops.convert_to_numpy(hvd.allgather(tensor(np.asarray(w)[None]), name=f"outer.{tag}.{i}"))
        assert np.array_equal(every[0], every[-1]), f"weight {i} differs between ranks ({tag})"


def fit(model, opt, callbacks=()):
    x, y = my_data()
    model.compile(optimizer=opt, loss=LOSS)
    model.fit(x, y, batch_size=PER_WORKER, epochs=1, shuffle=False, verbose=0, callbacks=list(callbacks))


def check_data_parallelism():
    """H = 1, outer lr 1, no momentum in model.fit: hvd.DistributedOptimizer('none')'s training."""
    ours, theirs = make_model(), make_model()
    if hvd.rank() == 1:  # a different start on rank 1: both runs start from rank 0's (the callback)
        ours.set_weights([w + 0.5 for w in ours.get_weights()])
        theirs.set_weights([w + 0.5 for w in theirs.get_weights()])
    fit(ours, hvd.OuterOptimizer(keras.optimizers.SGD(0.1), sync_every=1, outer_lr=1.0, outer_momentum=0.0,
                                 nesterov=False), [hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    fit(theirs, hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
        [hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    for a, b in zip(ours.get_weights(), theirs.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert_ranks_identical(ours, "dp")


def check_ranks_identical_int8():
    """DiLoCo (H 4, Nesterov) with AdamW inside, int8 pseudo-gradients: after the 12th step (a sync)
    every rank holds the same bits, and the loss fell."""
    model = make_model()
    x, y = my_data()
    opt = hvd.OuterOptimizer(keras.optimizers.AdamW(1e-2), sync_every=4, compression="int8",
                             policy=hvd.CompressionPolicy(min_elements=1))  # every tensor in int8
    model.compile(optimizer=opt, loss=LOSS)
    before = float(model.evaluate(x, y, verbose=0))
    model.fit(x, y, batch_size=PER_WORKER, epochs=1, shuffle=False, verbose=0)
    assert_ranks_identical(model, "int8")
    after = float(model.evaluate(x, y, verbose=0))
    assert after < before, (before, after)
    stats = opt.compression_stats()
    per_sync, fp32 = stats["sent_per_inner_step"] * 4, stats["fp32_per_step_of_data_parallelism"]
    # int8 is a quarter of float32 plus its scales and each small tensor's padding to a block:
    # seen 1040 B per sync against 3084 B for this 771-parameter model
    assert 0 < per_sync < fp32 / 2, (per_sync, fp32)


def check_auto():
    """sync_every="auto": after the probe (6 inner steps) every rank reports the same chosen H
    and the same measured figures; after the probe's sync the ranks hold the same bits."""
    model = make_model()
    x, y = my_data()
    opt = hvd.OuterOptimizer(keras.optimizers.SGD(0.05), sync_every="auto", compression="int8")
    model.compile(optimizer=opt, loss=LOSS)
    assert opt.compression_stats()["sync_every_auto"] is None  # not chosen yet
    model.fit(x[:6 * PER_WORKER], y[:6 * PER_WORKER], batch_size=PER_WORKER, epochs=1, shuffle=False, verbose=0)
    chosen = opt.compression_stats()["sync_every_auto"]
    every = hvd.allgather_object(chosen, name="outer.auto.chosen")
    assert chosen is not None and all(c == every[0] for c in every), every
    assert 1 <= chosen["sync_every"] <= 500, chosen
    assert_ranks_identical(model, "auto")


def check_join():
    """model.fit on shards of different lengths with hvd.callbacks.JoinCallback: rank 1 has 10
    batches, rank 0 12 (H = 4, int8: reduced in float32 while a rank has joined); after fit both
    ranks hold the same weights and outer state, and rank 0 made all 3 syncs."""
    model = make_model()
    x, y = my_data()
    n = (10 if hvd.rank() == 1 else 12) * PER_WORKER
    opt = hvd.OuterOptimizer(keras.optimizers.SGD(0.05), sync_every=4, compression="int8",
                             policy=hvd.CompressionPolicy(min_elements=1))
    model.compile(optimizer=opt, loss=LOSS)
    model.fit(x[:n], y[:n], batch_size=PER_WORKER, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.JoinCallback(), hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert_ranks_identical(model, "join")
    loop = outer_of(opt).loop
    every = hvd.allgather_object([loop.step, loop.outer_steps], name="outer.join.keras")
    assert every[0] == every[1] == [12, [3]], every
    assert all(np.isfinite(w).all() for w in model.get_weights())


def resume_and_compare(make, at, until, tag, lost_what):
    """Train ``make()``'s model for steps 0..``at``, hvd.save_checkpoint, go on to ``until``; a
    fresh ``make()`` loaded with hvd.load_checkpoint and trained ``at``..``until`` must give the
    same bits; one given the weights alone (the outer state lost) must not. -> the resumed model."""
    import os
    import tempfile
    x, y = my_data()

    def steps(model, first, last):
        sl = slice(first * PER_WORKER, last * PER_WORKER)
        model.fit(x[sl], y[sl], batch_size=PER_WORKER, epochs=1, shuffle=False, verbose=0)

    folder = hvd.broadcast_object(tempfile.mkdtemp(prefix=f"hvdp-outer-{tag}-") if hvd.rank() == 0 else None,
                                  name=f"outer.ckpt.{tag}.dir")
    path = os.path.join(folder, f"{tag}.keras")
    model = make()
    steps(model, 0, at)
    hvd.save_checkpoint(path, model, step=at)
    steps(model, at, until)
    resumed = make()
    _, extra = hvd.load_checkpoint(path, resumed)
    assert extra == {"step": at}, extra
    steps(resumed, at, until)
    for a, b in zip(model.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(a, b)
    lost = make()
    lost.load_weights(path)
    steps(lost, at, until)
    assert any(not np.array_equal(a, b) for a, b in zip(model.get_weights(), lost.get_weights())), \
        f"without {lost_what} the run is the same: the check cannot see it"
    return resumed


def check_checkpoint():
    """hvd.save_checkpoint after step 8 (a sync of H = 4; DiLoCo's outer momentum, int8
    residuals), hvd.load_checkpoint into a fresh model compiled with the same OuterOptimizer:
    4 more steps give the uninterrupted run's bits (the inner SGD has no state of its own); the
    weights alone (outer state lost) give other bits."""
    def make():
        model = make_model()
        model.compile(optimizer=hvd.OuterOptimizer(keras.optimizers.SGD(0.05), sync_every=4, compression="int8",
                                                   policy=hvd.CompressionPolicy(min_elements=1)), loss=LOSS)
        return model

    resumed = resume_and_compare(make, 8, 12, "ckpt", "the outer state")
    assert_ranks_identical(resumed, "ckpt")


def check_custom_loop():
    """A loop of its own: opt.apply(grads, variables) every step, a sync every 3rd."""
    model = make_model()
    x, y = my_data()
    opt = hvd.OuterOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), sync_every=3, compression="bf16")
    for s in range(6):
        bx, by = x[s * PER_WORKER:(s + 1) * PER_WORKER], y[s * PER_WORKER:(s + 1) * PER_WORKER]
        if TF:
            with tf.GradientTape() as tape:
                loss = LOSS(by, model(bx, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
        else:
            model.zero_grad()
            loss = LOSS(tensor(by), model(tensor(bx), training=True))
            loss.backward()
            grads = [v.value.grad for v in model.trainable_variables]
        opt.apply(grads, model.trainable_variables)
    assert_ranks_identical(model, "loop")


# warmup_steps: W synchronous steps, then periodic averaging (outer lr 1, no momentum) every H,
# SGD inside; 14 steps = W + 2 intervals + 3 steps into the third (the ranks apart at the end)
W, H, WARM_STEPS, WARM_LR = 3, 4, 14, 0.1
# float32 against float64, max |difference| over the 14 steps: seen 1.1e-7 (TF) and 9.4e-8 (torch);
# the same runs are 0.02-0.03 from the reference without the warm-up
REFERENCE_TOL = 1e-6


def ce_grads(params, x, y):
    """float64 gradients of the mean sparse cross-entropy of Dense(32, tanh) -> Dense(3) logits."""
    w1, b1, w2, b2 = params
    h = np.tanh(x @ w1 + b1)
    z = h @ w2 + b2
    e = np.exp(z - z.max(1, keepdims=True))
    d = e / e.sum(1, keepdims=True)
    d[np.arange(len(y)), y] -= 1
    d /= len(y)
    dh = (d @ w2.T) * (1 - h ** 2)
    return [x.T @ dh, dh.sum(0), h.T @ d, d.sum(0)]


def warmup_reference(start, steps=WARM_STEPS, warmup=W):
    """The algorithm in float64 on every rank's data: W steps of SGD on the ranks' mean gradient,
    then each rank's own SGD steps, its parameters replaced every H of them by the global ones
    moved by the outer SGD (lr 1, no momentum) on the mean pseudo-gradient. -> per step (1-based
    index - 1), each rank's parameters."""
    data = [my_data(steps, r) for r in range(hvd.size())]
    def batch(r, s):
        x, y = data[r]
        return x[s * PER_WORKER:(s + 1) * PER_WORKER].astype(np.float64), y[s * PER_WORKER:(s + 1) * PER_WORKER]
    p = [np.asarray(w, np.float64) for w in start]
    trail = []
    for s in range(warmup):
        g = [np.mean(gs, axis=0) for gs in zip(*(ce_grads(p, *batch(r, s)) for r in range(len(data))))]
        p = [a - WARM_LR * b for a, b in zip(p, g)]
        trail.append([p] * len(data))
    glob, local = p, [p] * len(data)
    for s in range(warmup, steps):
        local = [[a - WARM_LR * b for a, b in zip(mine, ce_grads(mine, *batch(r, s)))] for r, mine in enumerate(local)]
        if (s - warmup + 1) % H == 0:
            glob = [g - 1.0 * np.mean([g - loc[i] for loc in local], axis=0) for i, g in enumerate(glob)]
            local = [glob] * len(data)
        trail.append(local)
    return trail


def warmup_optimizer():
    return hvd.OuterOptimizer(keras.optimizers.SGD(WARM_LR), sync_every=H, outer_lr=1.0, outer_momentum=0.0,
                              nesterov=False, warmup_steps=W)


def assert_follows_reference(start, trail, tag):
    """Each step's parameters of this rank against the float64 reference, within REFERENCE_TOL;
    the same run without the warm-up (its W steps local) is far outside it."""
    ref = warmup_reference(start)
    worst = max(float(np.max(np.abs(a - b))) for s, ws in enumerate(trail) for a, b in zip(ws, ref[s][hvd.rank()]))
    assert len(trail) == WARM_STEPS and worst <= REFERENCE_TOL, (tag, len(trail), worst)
    unwarmed = warmup_reference(start, warmup=0)[-1][hvd.rank()]  # the first interval from step 1
    apart = max(float(np.max(np.abs(a - b))) for a, b in zip(trail[-1], unwarmed))
    assert apart > 100 * REFERENCE_TOL or hvd.size() == 1, (tag, apart)  # one rank: nothing to average
    print(f"warm-up {tag} rank {hvd.rank()}: max |float32 - float64 reference| {worst:.3g} over {len(trail)} "
          f"steps (tolerance {REFERENCE_TOL:g}); without the warm-up {apart:.3g}", flush=True)


def check_warmup_fit():
    """warmup_steps=3, H = 4, outer lr 1, no momentum, codec none, in model.fit (TensorFlow: the
    step traced once, the warm-up decided as each step runs): after the 3 warm-up steps the
    weights equal hvd.DistributedOptimizer('none')'s after the same 3 steps (within 1e-6) and
    are the same bits on both ranks; every step follows the float64 reference."""
    x, y = my_data(WARM_STEPS)
    model = make_model()
    start = model.get_weights()
    traced = []

    def loss(t, z):  # where the step runs Python: TensorFlow traces it, torch runs it each step
        traced.append(TF and not tf.executing_eagerly())
        return LOSS(t, z)
    trail = []
    def after_batch(batch, logs=None):
        trail.append(model.get_weights())
        if batch == W - 1:
            assert_ranks_identical(model, "warm")
    opt = warmup_optimizer()
    model.compile(optimizer=opt, loss=loss)
    model.fit(x, y, batch_size=PER_WORKER, epochs=1, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=after_batch)])
    if TF:
        assert not model.run_eagerly and all(traced) and len(traced) <= 2, traced
    loop = outer_of(opt).loop
    assert (loop.warm, loop.step, loop.outer_steps) == (W, WARM_STEPS - W, [2]), (loop.warm, loop.step)
    dp = make_model()
    dp.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(WARM_LR)), loss=LOSS)
    dp.fit(x[:W * PER_WORKER], y[:W * PER_WORKER], batch_size=PER_WORKER, epochs=1, shuffle=False, verbose=0)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(trail[W - 1], dp.get_weights()))
    assert diff <= 1e-6, diff
    print(f"warm-up fit rank {hvd.rank()}: after {W} steps max |outer - DistributedOptimizer| {diff:.3g} "
          "(tolerance 1e-6)", flush=True)
    assert_follows_reference(start, trail, "fit")


def check_warmup_custom_loop():
    """The same run in a loop of its own (opt.apply each step), against the float64 reference;
    on TensorFlow once eagerly and once with the step in a tf.function."""
    x, y = my_data(WARM_STEPS)
    for traced in ([False, True] if TF else [False]):
        model, opt = make_model(), warmup_optimizer()
        start = model.get_weights()

        def step(bx, by):
            if TF:
                with tf.GradientTape() as tape:
                    loss = LOSS(by, model(bx, training=True))
                opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            else:
                model.zero_grad()
                LOSS(by, model(bx, training=True)).backward()
                opt.apply([v.value.grad for v in model.trainable_variables], model.trainable_variables)
        if traced:
            step = tf.function(step)
        trail = []
        for s in range(WARM_STEPS):
            sl = slice(s * PER_WORKER, (s + 1) * PER_WORKER)
            step(tensor(x[sl]), tensor(y[sl]))
            trail.append(model.get_weights())
            if s == W - 1:
                assert_ranks_identical(model, f"warm.loop.{traced}")
        assert outer_of(opt).loop.warm == W
        assert_follows_reference(start, trail, "tf.function loop" if traced else "loop")


def check_checkpoint_warmup():
    """hvd.save_checkpoint after step 2 of the 3 warm-up steps, loaded into a fresh model: it
    warms up one step more and then follows the uninterrupted run's bits to step 10 (each rank
    its own: 3 steps after the sync at step 7); the weights alone (the warm-up count lost: 3
    warm-up steps again) give other bits."""
    def make():
        model = make_model()
        model.compile(optimizer=warmup_optimizer(), loss=LOSS)
        return model

    resumed = resume_and_compare(make, 2, 10, "warm", "the warm-up count")
    loop = outer_of(resumed.optimizer).loop
    assert (loop.warm, loop.step) == (W, 10 - W), (loop.warm, loop.step)


def check_warmup_codec():
    """warmup_compression="int8" in model.fit: after the W warm-up steps the weights are
    hvd.DistributedOptimizer(compression="int8")'s after the same steps (the same engine and
    codec: the same bits), every rank the same, the warm-up's bytes in compression_stats(); a
    checkpoint in the middle of the warm-up (its residuals saved) resumes to the uninterrupted
    run's bits. The policy's own first step is float32 in both (its warmup_steps)."""
    pol = hvd.CompressionPolicy(min_elements=1, warmup_steps=1)

    def make():
        model = make_model()
        model.compile(optimizer=hvd.OuterOptimizer(keras.optimizers.SGD(WARM_LR), sync_every=H, outer_lr=1.0,
                                                   outer_momentum=0.0, nesterov=False, warmup_steps=W,
                                                   warmup_compression="int8", policy=pol), loss=LOSS)
        return model
    x, y = my_data(WARM_STEPS)
    model = make()
    model.fit(x[:W * PER_WORKER], y[:W * PER_WORKER], batch_size=PER_WORKER, epochs=1, shuffle=False, verbose=0)
    assert_ranks_identical(model, "warm.int8")
    dp = make_model()
    dp.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(WARM_LR), compression="int8", policy=pol),
               loss=LOSS)
    dp.fit(x[:W * PER_WORKER], y[:W * PER_WORKER], batch_size=PER_WORKER, epochs=1, shuffle=False, verbose=0)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), dp.get_weights()))
    assert diff == 0.0, f"the int8 warm-up differs from hvd.DistributedOptimizer(compression='int8'): {diff:.3g}"
    warm = model.optimizer.compression_stats()["warmup"]
    last, total = warm["last_step"]["all"], warm["total"]["all"]  # the last step int8, the first ones float32
    assert 0 < last["sent"] < 0.4 * last["fp32"] and last["sent"] < total["sent"] < total["fp32"], warm
    resume_and_compare(make, 2, 10, "warm_int8", "the warm-up count and residuals")


def check_refusals():
    # warmup_steps not given: rank 0 warns once; given (0 too): no warning
    import warnings
    from hvdp.outer import NoWarmupWarning
    for kwargs, warned in (({}, hvd.rank() == 0), ({"warmup_steps": 0}, False)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            hvd.OuterOptimizer(keras.optimizers.SGD(0.1), sync_every=4, **kwargs)
        got = [w for w in seen if issubclass(w.category, NoWarmupWarning)]
        assert len(got) == int(warned), (kwargs, [str(w.message) for w in got])
    for kwargs, text in (({}, "needs sync_every=H"), ({"sync_every": 4, "compression": "powersgd"}, "not one here"),
                         ({"sync_every": 4, "fragments": 5}, "more than sync_every"),
                         ({"sync_every": 4, "warmup_steps": -1}, "warmup must be an integer >= 0"),
                         ({"sync_every": 4, "hierarchical": True}, "do not combine with the two-level reduction"),
                         ({"sync_every": 4, "warmup_steps": 2, "warmup_compression": "auto"}, "not one here"),
                         ({"sync_every": 4, "warmup_compression": "int8"}, "without warmup_steps")):
        try:
            hvd.OuterOptimizer(keras.optimizers.SGD(0.1), **kwargs)
        except ValueError as e:
            assert text in str(e), str(e)
        else:
            raise AssertionError(f"{kwargs} was accepted")
    try:
        hvd.OuterOptimizer(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), sync_every=4)
    except ValueError as e:
        assert "plain Keras optimizer" in str(e), str(e)
    else:
        raise AssertionError("a DistributedOptimizer was accepted")


if __name__ == "__main__":
    hvd.init()
    for name in sys.argv[1:]:
        globals()[f"check_{name}"]()
        print(f"CHECK {name} OK rank={hvd.rank()}", flush=True)
