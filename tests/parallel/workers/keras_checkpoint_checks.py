"""hvdp.keras checkpoints under real workers: the ModelCheckpoint callback, resume at the same
size, and at another number of workers (the residual rule of
``hvdp.reduce.twophase.TwoPhaseReducer.load_state_dict``); run as checks of keras_checks.py (its jobs)."""
import os
import tempfile

import keras
import numpy as np

import hvdp.keras as hvd
from hvdp.keras.state import state_of
from keras_checks import LOSS, allgathered, assert_ranks_identical, data, make_model, shard, tensor

def check_checkpoint_callback():
    folder = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None, name="kck.dir")
    path = os.path.join(folder, "model.keras")
    x, y = data(32)
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss=LOSS)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0,
              callbacks=[hvd.callbacks.ModelCheckpoint(path)])
    hvd.allreduce(tensor(np.zeros(1)), name="kck.barrier")
    if hvd.rank() == 0:
        assert os.listdir(folder) == ["model.keras"], os.listdir(folder)  # no temporary left
        restored = keras.models.load_model(path, compile=False)
        for a, b in zip(restored.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(a, b)


RESUME_POLICY = dict(min_elements=1)  # every tensor in an int8 bucket: residuals everywhere


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def _one_more_step(model, xs, ys):
    model.fit(xs[:8], ys[:8], batch_size=8, epochs=1, shuffle=False, verbose=0)
    return _weights(model)


def check_resume():
    """The step after resuming from hvd.callbacks.ModelCheckpoint (or hvd.save_checkpoint) equals
    the uninterrupted step exactly; without the residuals it does not."""
    folder = os.environ.get("HVDP_TEST_CKPT_DIR") or tempfile.mkdtemp()
    folder = hvd.broadcast_object(folder if hvd.rank() == 0 else None, name="krs.dir")
    path = os.path.join(folder, "resume.keras")
    x, y = data(16 * 8 * hvd.size(), seed=5)
    xs, ys = shard(x, y, 8)
    policy = hvd.CompressionPolicy(**RESUME_POLICY)
    model = make_model()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), compression="int8", policy=policy)
    model.compile(optimizer=opt, loss=LOSS)
    model.fit(xs, ys, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.ModelCheckpoint(path)])
    saved = state_of(opt).residual_state()
    assert any(np.abs(v).max() > 0 for v in saved["worker"].values()), "no residual to keep"
    # the ranks' residuals differ (per-worker state): each must get its own back
    mine = np.concatenate([saved["worker"][k] for k in sorted(saved["worker"])])
    every = allgathered(mine, "krs.mine")
    assert not np.array_equal(every[0], every[-1])
    hvd.save_checkpoint(os.path.join(folder, "pair.keras"), model, epoch=2)
    uninterrupted = _one_more_step(model, xs, ys)

    for how in ("load_model", "load_checkpoint"):
        if how == "load_model":
            resumed = hvd.load_model(path, compression="int8", policy=policy)
        else:
            fresh = make_model(seed=99)
            fresh.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                                             compression="int8", policy=policy), loss=LOSS)
            resumed, extra = hvd.load_checkpoint(os.path.join(folder, "pair.keras"), fresh)
            assert extra == {"epoch": 2}, extra
        got = state_of(resumed.optimizer).residual_state()
        for side in ("worker", "server"):
            for k, v in saved[side].items():
                np.testing.assert_array_equal(got[side][k], v)
        after = _one_more_step(resumed, xs, ys)
        for a, b in zip(after, uninterrupted):
            np.testing.assert_array_equal(a, b)  # exactly
        assert_ranks_identical(resumed, f"krs.{how}")
    # the same resume with the residuals zeroed does not give the same step: they matter
    zeroed = hvd.load_model(path, compression="int8", policy=policy)
    state_of(zeroed.optimizer).load_residual_state({})
    assert not all(np.array_equal(a, b) for a, b in zip(_one_more_step(zeroed, xs, ys), uninterrupted))


OTHER_SIZE_POLICY = dict(min_elements=1, fusion_threshold_bytes=4)  # one int8 bucket per tensor


def other_size_model(seed=0):
    """Bucket lengths for which the rule has both outcomes: a 320-element bucket's padded length
    is the same at 1 and 2 workers, a 1280-element one's at 2 and 3 workers; the others change."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((20,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(80, activation="tanh"), keras.layers.Dense(3)])


def check_save_for_other_size():
    """At 2 workers: a few int8 steps, then hvd.save_checkpoint into $HVDP_TEST_CKPT_DIR for
    check_resume_other_size (run at 1 and 3 workers)."""
    folder = os.environ.get("HVDP_TEST_CKPT_DIR") or tempfile.mkdtemp()
    folder = hvd.broadcast_object(folder if hvd.rank() == 0 else None, name="kos.dir")
    x, y = data(3 * 8 * hvd.size(), seed=5)
    xs, ys = shard(x, y, 8)
    model = other_size_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), compression="int8",
                                                     policy=hvd.CompressionPolicy(**OTHER_SIZE_POLICY)), loss=LOSS)
    model.fit(xs, ys, batch_size=8, epochs=1, shuffle=False, verbose=0)
    worker = state_of(model.optimizer).residual_state()["worker"]
    assert len(worker) == 6 and all(np.any(v) for v in worker.values()), "no residuals to keep"
    hvd.save_checkpoint(os.path.join(folder, "other_size.keras"), model, epoch=1)


def check_resume_other_size():
    """Run at another number of workers (1, 3) on the checkpoint check_save_for_other_size wrote
    with 2: the rule of hvdp.keras.checkpoint (the same as torch's; it lives in
    hvdp.reduce.twophase.TwoPhaseReducer.load_state_dict): rank r keeps the worker residual rank r saved
    where the bucket's padded length is unchanged, else zero; the server residual from zero; a
    rank that did not exist from zero."""
    from hvdp.reduce.twophase import chunk_length
    from hvdp.keras.checkpoint import read_residuals
    path = os.path.join(os.environ["HVDP_TEST_CKPT_DIR"], "other_size.keras")
    per_rank, _ = read_residuals(path)
    assert len(per_rank) == 2 and hvd.size() != 2, (len(per_rank), hvd.size())
    assert any(not np.array_equal(per_rank[0]["worker"][k], per_rank[1]["worker"][k]) for k in per_rank[0]["worker"])
    model = hvd.load_model(path, compression="int8", policy=hvd.CompressionPolicy(**OTHER_SIZE_POLICY))
    red, r = state_of(model.optimizer), hvd.rank()
    got = red.residual_state()
    mine = per_rank[r]["worker"] if r < len(per_rank) else {}
    kept = []
    for b, idx in enumerate(red.plan.buckets):
        n, k = sum(red.engine.numels[i] for i in idx), f"b{b}"
        old_padded = chunk_length(n, 2, red.engine.codec.align) * 2
        assert got["worker"][k].size == red.engine.reducer.layout(n)[1], k  # sized for this world
        if old_padded == got["worker"][k].size and k in mine:
            kept.append(n)
            np.testing.assert_array_equal(got["worker"][k], mine[k])
            assert np.any(got["worker"][k]), k
        else:
            np.testing.assert_array_equal(got["worker"][k], np.zeros_like(got["worker"][k]))
        assert not np.any(got["server"][k]), "server residual not reset at another size"
    want = {1: [320], 3: [1280]}.get(hvd.size(), []) if r < 2 else []
    assert kept == want, (hvd.size(), r, kept, want)
    print(f"  size {hvd.size()} rank {r}: worker residuals kept for buckets of {kept} elements", flush=True)
    x, y = data(16, seed=5)
    h = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert np.isfinite(h.history["loss"][-1])


def _every_rank_same_error(save, path, errno_, cause, tag):
    """``save()`` fails on every rank with the same CheckpointWriteError naming ``path`` and
    ``cause``; -> its message."""
    from hvdp.checkpoint import CheckpointWriteError
    try:
        save()
    except CheckpointWriteError as e:
        got = (type(e).__name__, e.errno, e.filename, str(e))
    else:
        raise AssertionError(f"rank {hvd.rank()}: saving to {path} did not fail")
    every = hvd.allgather_object(got, name=f"kdisk.{tag}")
    assert all(g == every[0] for g in every), every  # the same error on every rank
    assert got[1] == errno_ and got[2] == path and path in got[3] and cause in got[3], got
    assert "No rank has saved" in got[3], got
    if hvd.rank() == 0:
        print(f"  {got[3]}", flush=True)
    return got[3]


def check_full_or_read_only_disk():
    """hvd.save_checkpoint and hvd.callbacks.ModelCheckpoint onto a full 256 KiB tmpfs
    ($HVDP_TEST_DISK_FULL) and a read-only bind mount ($HVDP_TEST_DISK_RO of
    $HVDP_TEST_DISK_RO_SRC), mounted by the test: a first checkpoint that fits, then a model that
    does not: every rank raises the same CheckpointWriteError (out of ``fit`` for the callback)
    naming the path and the cause; the first files load and equal what was saved; no temporary
    file is left."""
    import errno
    full, ro, src = (os.environ[k] for k in ("HVDP_TEST_DISK_FULL", "HVDP_TEST_DISK_RO", "HVDP_TEST_DISK_RO_SRC"))
    x, y = data(16, seed=5)
    small = make_model()
    small.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="int8",
                                                     policy=hvd.CompressionPolicy(**RESUME_POLICY)), loss=LOSS)
    keras.utils.set_random_seed(0)
    big = keras.Sequential([keras.Input((300,)), keras.layers.Dense(300)])  # 361 KB: more than the tmpfs
    big.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    bx, by = np.ones((8, 300), "float32"), np.zeros((8, 300), "float32")
    for folder, view, errno_, cause in ((full, full, errno.ENOSPC, "No space left on device"),
                                        (src, ro, errno.EROFS, "Read-only file system")):
        small.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[hvd.callbacks.ModelCheckpoint(os.path.join(folder, "cb.keras"))])
        hvd.save_checkpoint(os.path.join(folder, "m.keras"), small, epoch=1)
        first = _weights(small)
        for name in ("m.keras", "cb.keras"):
            path = os.path.join(view, name)
            if name == "m.keras":
                msg = _every_rank_same_error(lambda: hvd.save_checkpoint(path, big, epoch=2), path, errno_, cause,
                                             f"{errno_}.{name}")
            else:
                msg = _every_rank_same_error(
                    lambda: big.fit(bx, by, batch_size=8, epochs=1, verbose=0,
                                    callbacks=[hvd.callbacks.ModelCheckpoint(path)]),
                    path, errno_, cause, f"{errno_}.{name}")
                assert msg.startswith("hvd.callbacks.ModelCheckpoint: rank 0"), msg
            if errno_ == errno.ENOSPC:
                assert "bytes reached the temporary file" in msg, msg
        assert sorted(os.listdir(view)) == ["cb.keras", "m.keras"], os.listdir(view)  # no temporary left
        fresh = make_model(seed=99)
        fresh.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="int8",
                                                         policy=hvd.CompressionPolicy(**RESUME_POLICY)), loss=LOSS)
        resumed, extra = hvd.load_checkpoint(os.path.join(view, "m.keras"), fresh)
        assert extra == {"epoch": 1}, extra
        for a, b in zip(_weights(resumed), first):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(keras.models.load_model(os.path.join(view, "cb.keras"), compile=False).get_weights(), first):
            np.testing.assert_array_equal(a, b)
    hvd.save_checkpoint(os.path.join(src, "after.keras"), big, epoch=3)  # the ranks are still in step
    assert hvd.load_checkpoint(os.path.join(src, "after.keras"), big)[1] == {"epoch": 3}
