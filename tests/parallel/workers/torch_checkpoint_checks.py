"""hvdp.torch checkpoints under real workers: resume at the same size, and at another number of
workers (the residual rule of ``hvdp.reduce.twophase.TwoPhaseReducer.load_state_dict``); run as checks of
torch_checks.py (its jobs)."""
import torch

import hvdp.torch as hvd
from torch_checks import model_and_data, my_slice, params_close, train

def check_checkpoint_resume():
    import tempfile
    path = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None, name="ck.dir") + "/c.pt"
    model, x, y = model_and_data(seed=5)

    def make(m):
        return hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=m.named_parameters(), compression="int8",
                                        policy=hvd.CompressionPolicy(min_elements=1))
    opt = make(model)
    sl = my_slice(len(x))
    train(model, opt, x[sl], y[sl], 3)
    hvd.save_checkpoint(path, model, opt, epoch=7)
    mine = {k: v.clone() for k, v in opt.engine.reducer.worker_residual.items()}
    model2 = model_and_data(seed=99)[0]
    opt2 = make(model2)
    assert hvd.load_checkpoint(path, model2, opt2) == {"epoch": 7}
    for k, v in mine.items():  # this rank's own residuals, not rank 0's
        assert torch.equal(opt2.engine.reducer.worker_residual[k], v)
    train(model, opt, x[sl], y[sl], 1)
    train(model2, opt2, x[sl], y[sl], 1)
    params_close(model, model2, tol=0.0)


OTHER_SIZE_FILE = "other_size.pt"


def other_size_model_and_opt(seed, compression="int8"):
    """One int8 bucket per tensor, lengths chosen so that the rule has both outcomes: the padded
    length of a 320-element bucket is the same at 1 and 2 workers, of a 1280-element one at 2
    and 3 workers; the others change."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.Tanh(), torch.nn.Linear(16, 80),
                                torch.nn.Tanh(), torch.nn.Linear(80, 3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=compression,
                                   policy=hvd.CompressionPolicy(min_elements=1, fusion_threshold_bytes=4))
    return model, opt


def check_save_for_other_size():
    """At 2 workers: a few int8 steps, then hvd.save_checkpoint into $HVDP_TEST_CKPT_DIR for
    check_resume_other_size (run at 1 and 3 workers); and top-k / PowerSGD checkpoints loaded
    back with the safe default (weights_only=True)."""
    import os
    import tempfile
    folder = os.environ.get("HVDP_TEST_CKPT_DIR") or tempfile.mkdtemp()
    folder = hvd.broadcast_object(folder if hvd.rank() == 0 else None, name="ckos.dir")
    model, opt = other_size_model_and_opt(seed=3)
    _, x, y = model_and_data(seed=3)
    train(model, opt, x[my_slice(len(x))], y[my_slice(len(x))], 3)
    worker = opt.engine.reducer.worker_residual
    assert len(worker) == 6 and all(v.abs().max() > 0 for v in worker.values()), "no residuals to keep"
    hvd.save_checkpoint(os.path.join(folder, OTHER_SIZE_FILE), model, opt, epoch=3)
    # top-k and PowerSGD residuals of real workers load with the default weights_only=True too
    for codec in ("topk", "powersgd"):
        m, o = other_size_model_and_opt(seed=3, compression=codec)
        train(m, o, x[my_slice(len(x))], y[my_slice(len(x))], 2)
        path = os.path.join(folder, f"{codec}.pt")
        hvd.save_checkpoint(path, m, o, epoch=2, note=codec, sizes=[1, 2.5], t=torch.ones(2))
        m2, o2 = other_size_model_and_opt(seed=98, compression=codec)
        extra = hvd.load_checkpoint(path, m2, o2)
        assert extra["note"] == codec and extra["sizes"] == [1, 2.5] and torch.equal(extra["t"], torch.ones(2))
        for side in ("worker", "server"):
            want, got = getattr(o.engine.reducer, side).snapshot(), getattr(o2.engine.reducer, side).snapshot()
            assert sorted(want) == sorted(got) and want, (codec, side)
            for k in want:
                assert torch.equal(want[k], got[k]), (codec, side, k)


def check_resume_other_size():
    """At another number of workers than check_save_for_other_size's 2: the module rule of
    hvdp.torch.checkpoint (the same as Keras'): rank r keeps the worker residual rank r saved
    where the bucket's padded length is unchanged, else it starts from zero; the server
    residual starts from zero; a rank that did not exist starts from zero."""
    import os

    import numpy as np

    from hvdp.reduce.residuals import previous
    from hvdp.reduce.twophase import chunk_length
    path = os.path.join(os.environ["HVDP_TEST_CKPT_DIR"], OTHER_SIZE_FILE)
    saved = torch.load(path, weights_only=True)
    per_rank = saved["hvdp_per_rank"]
    assert saved["size"] == 2 == len(per_rank) and hvd.size() != 2, (saved["size"], hvd.size())
    w0, w1 = (per_rank[i]["reducer"]["worker"] for i in (0, 1))
    assert any(not torch.equal(w0[k], w1[k]) for k in w0), "the saved ranks' residuals are the same"
    model, opt = other_size_model_and_opt(seed=99)
    assert hvd.load_checkpoint(path, model, opt) == {"epoch": 3}
    for a, b in zip(model.state_dict().values(), saved["model"].values()):
        assert torch.equal(a, b)
    eng, r = opt.engine, hvd.rank()
    red = eng.reducer
    mine = per_rank[r]["reducer"]["worker"] if r < len(per_rank) else {}
    kept = []
    for b, idx in enumerate(eng.plan.buckets):
        k, n = f"b{b}", sum(eng.numels[i] for i in idx)
        c, padded = red.layout(n)
        got = previous(eng.ops, red.worker, k, padded)  # what the next step adds: None = zero
        got = np.zeros(padded, np.float32) if got is None else got.numpy()
        same = chunk_length(n, 2, eng.codec.align) * 2 == padded
        if same and k in mine:
            kept.append(n)
            np.testing.assert_array_equal(got, mine[k].numpy())
            assert np.any(got), k
        else:
            np.testing.assert_array_equal(got, np.zeros(padded, np.float32))
        server = previous(eng.ops, red.server, k, c)
        assert server is None or not np.any(server.numpy()), f"server residual {k} not reset"
    want = {1: [320], 3: [1280]}.get(hvd.size(), []) if r < 2 else []
    assert kept == want, (hvd.size(), r, kept, want)
    assert eng.step == per_rank[0]["step"], (eng.step, per_rank[0]["step"])
    _, x, y = model_and_data(seed=3)
    train(model, opt, x[my_slice(len(x))], y[my_slice(len(x))], 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    print(f"  size {hvd.size()} rank {r}: worker residuals kept for buckets of {kept} elements", flush=True)


def _every_rank_same_error(save, path, errno_, cause):
    """``save()`` fails on every rank with the same CheckpointWriteError naming ``path`` and
    ``cause``; -> its message."""
    from hvdp.checkpoint import CheckpointWriteError
    try:
        save()
    except CheckpointWriteError as e:
        got = (type(e).__name__, e.errno, e.filename, str(e))
    else:
        raise AssertionError(f"rank {hvd.rank()}: saving to {path} did not fail")
    every = hvd.allgather_object(got, name=f"disk.err.{errno_}")
    assert all(g == every[0] for g in every), every  # the same error on every rank
    assert got[1] == errno_ and got[2] == path and path in got[3] and cause in got[3], got
    assert "No rank has saved" in got[3], got
    return got[3]


def check_full_or_read_only_disk():
    """$HVDP_TEST_DISK_FULL: a 256 KiB tmpfs; $HVDP_TEST_DISK_RO: a read-only bind mount of
    $HVDP_TEST_DISK_RO_SRC (mounted by the test). A checkpoint that fits, then one that does not
    (or any on the read-only view): every rank raises the same CheckpointWriteError naming the
    path and the cause, the first file loads and equals what was saved, no temporary is left,
    and the ranks go on in step."""
    import errno
    import os
    full, ro, src = (os.environ[k] for k in ("HVDP_TEST_DISK_FULL", "HVDP_TEST_DISK_RO", "HVDP_TEST_DISK_RO_SRC"))
    model, x, y = model_and_data(seed=5)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression="int8",
                                   policy=hvd.CompressionPolicy(min_elements=1))
    train(model, opt, x[my_slice(len(x))], y[my_slice(len(x))], 2)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    big = torch.nn.Linear(300, 300)  # 361 KB of float32: more than the whole tmpfs
    big_opt = hvd.DistributedOptimizer(torch.optim.SGD(big.parameters(), lr=0.1),
                                       named_parameters=big.named_parameters())
    for folder, view, errno_, cause in ((full, full, errno.ENOSPC, "No space left on device"),
                                        (src, ro, errno.EROFS, "Read-only file system")):
        hvd.save_checkpoint(os.path.join(folder, "c.pt"), model, opt, epoch=1)
        path = os.path.join(view, "c.pt")
        msg = _every_rank_same_error(lambda: hvd.save_checkpoint(path, big, big_opt, epoch=2), path, errno_, cause)
        if hvd.rank() == 0:
            print(f"  {msg}", flush=True)
        if errno_ == errno.ENOSPC:
            assert "bytes handed to the file" in msg, msg
        assert os.listdir(view) == ["c.pt"], os.listdir(view)  # no temporary file left
        model2 = model_and_data(seed=99)[0]
        opt2 = hvd.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1),
                                        named_parameters=model2.named_parameters(), compression="int8",
                                        policy=hvd.CompressionPolicy(min_elements=1))
        assert hvd.load_checkpoint(path, model2, opt2) == {"epoch": 1}
        for k, v in model2.state_dict().items():
            assert torch.equal(v, first[k]), k
    # the ranks are still in step: the next collective save (to a disk with room) works
    hvd.save_checkpoint(os.path.join(src, "after.pt"), big, big_opt, epoch=3)
    assert hvd.load_checkpoint(os.path.join(src, "after.pt"), big, big_opt) == {"epoch": 3}
