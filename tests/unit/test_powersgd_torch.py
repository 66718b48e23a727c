"""powersgd against PyTorch's own ``powerSGD_hook`` (DDP's communication hook) on the same
gradients, rank and initial Q, for several steps: outputs and error-feedback residuals.

The hook runs in a single-process gloo group, called directly with a stand-in for DDP's
``GradBucket`` (its flat buffer and per-tensor views). What differs by design, and why the
comparison still holds here:

- the initial Q: the hook seeds torch's generator from ``np.random.RandomState(random_seed)``
  and draws each Q with ``torch.randn`` in its order (tensors grouped by shape); hvdp draws from
  numpy by (seed, bucket name). The test injects the hook's draws (``init_q``), so both start
  from the same Q;
- which tensors are compressed: the same rule, (n + m) * r * min_compression_rate < n * m, on
  (shape[0], prod(rest)); but hvdp never compresses a vector (the hook would, as n x 1, at a
  min_compression_rate below 1) and the engine's policy keeps small tensors out of buckets;
- the residual of an uncompressed tensor: the hook keeps x - average (its mean over the ranks is
  zero), hvdp keeps none; on one process both are zero;
- orthogonalisation: both Gram-Schmidt at rank <= 2 and QR above, epsilon 0; hvdp leaves a zero
  column zero (the hook divides by its zero norm: NaN) and keeps a zero Q column out of the warm
  start;
- dtype: hvdp always reduces float32 (the hook works in the bucket's dtype) and does not batch
  matrices of the same shape (the hook's ``batch_tensors_with_same_shape``, off by default).

Tolerance: torch ops against the hook, 1e-6 of the largest |value| (the same float32 operations
in another order; seen: 4e-7 at rank 1, bit-equal at ranks 2 and 4); the numpy reference ops,
1e-5 (float64 QR, other summation orders; seen: 6e-7).
"""
import importlib.util
import os
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
hook_mod = pytest.importorskip("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook")

from hvdp import codecs  # noqa: E402
from hvdp.reduce.lowrank import LowRankReducer  # noqa: E402
from hvdp.ops import NumpyOps  # noqa: E402
from hvdp.reduce.simcomm import FakeGroup  # noqa: E402

# two of the same shape (the hook draws Qs grouped by shape), a conv-like 4-D weight, a vector,
# a matrix too small to compress at rank 2
SHAPES = [(24, 16), (16,), (8, 3, 3, 3), (24, 16), (4, 4), (10, 30)]
STEPS = 4
TOL = {"torch": 1e-6, "numpy": 1e-5}


def torch_ops():
    """hvdp.torch's array ops, loaded from their file: importing hvdp.torch would start Horovod,
    which this comparison does not need."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "adapters", "torch", "ops.py")
    spec = importlib.util.spec_from_file_location("_hvdp_torch_ops", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.TorchOps()


def _load_fake_bucket():
    """DDP's GradBucket stand-in, from the parallel workers' folder (shared with their check)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parallel", "workers",
                        "ddp_bucket.py")
    spec = importlib.util.spec_from_file_location("_hvdp_ddp_bucket", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.FakeBucket


FakeBucket = _load_fake_bucket()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gloo():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("a process group of several ranks is already set up in this process")
        yield
        return
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}")
    yield
    dist.destroy_process_group()  # only the group this module made


def hook_init(codec, seed):
    """The hook's initial Qs, in hvdp's order: one seed from the RandomState per bucket, Qs
    drawn in the hook's order (tensors grouped by shape, in order of first appearance)."""
    rng = np.random.RandomState(seed)

    def init(name, dims):
        mats = [(i, codec.matrix(s)) for i, s in enumerate(SHAPES) if codec.matrix(s)]
        by_shape = {}
        for i, (n, m, r) in mats:
            by_shape.setdefault((n, m), []).append((i, m, r))
        torch.manual_seed(rng.randint(1_000_000_000))
        drawn = {i: torch.randn(1, m, r, dtype=torch.float32)[0].numpy()
                 for group in by_shape.values() for i, m, r in group}
        out = [drawn[i] for i, _ in mats]
        assert [q.shape for q in out] == [tuple(d) for d in dims]
        return out
    return init


def gradients(seed=0):
    rng = np.random.default_rng(seed)
    n = sum(int(np.prod(s)) for s in SHAPES)
    return [rng.standard_normal(n).astype(np.float32) * (1 + t) for t in range(STEPS)]


@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("ops_name", ["torch", "numpy"])
def test_matches_torch_powerSGD_hook(gloo, rank, ops_name):
    codec = codecs.get("powersgd", rank=rank)
    state = hook_mod.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                                   min_compression_rate=2, use_error_feedback=True, warm_start=True,
                                   random_seed=0)
    state.iter = state.start_powerSGD_iter  # past the hook's plain-allreduce warm-up
    if ops_name == "torch":
        ops, to = torch_ops(), torch.from_numpy
    else:
        ops, to = NumpyOps(), (lambda a: a)
    red = LowRankReducer(codec, ops, FakeGroup(1).comms[0], True, init_q=hook_init(codec, 0))
    red.set_shapes({"b0": SHAPES})
    for t, g in enumerate(gradients()):
        buf = torch.from_numpy(g.copy())
        want = hook_mod.powerSGD_hook(state, FakeBucket(buf, SHAPES)).wait()
        pend = red.start("b0", to(g.copy()))
        red.exchange(pend)
        got = np.asarray(red.finish(pend))
        scale = float(want.abs().max())
        err = float(np.abs(got - want.numpy()).max())
        assert err <= TOL[ops_name] * scale, (t, err / scale)
        res_err = float(np.abs(np.asarray(red.worker.get("b0")) - state.error_dict[0].numpy()).max())
        assert res_err <= TOL[ops_name] * scale, (t, res_err / scale)
