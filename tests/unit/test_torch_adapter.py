"""The torch adapter without processes: its ops against the numpy reference, and its API surface."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
hvd_torch = pytest.importorskip("horovod.torch")

import hvdp.torch as hvd  # noqa: E402
from hvdp import codecs  # noqa: E402
from hvdp.ops import NumpyOps  # noqa: E402

RNG = np.random.default_rng(5)


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "int8", "int4", "topk"])
def test_torch_ops_match_numpy_reference(name):
    codec = codecs.get(name)
    x = (RNG.standard_normal(4096) * RNG.uniform(0.01, 100, 4096)).astype(np.float32)
    x[2000] = -np.inf
    ref_payload = codec.encode(NumpyOps(), x)
    payload = codec.encode(hvd.TorchOps(), torch.from_numpy(x.copy()))
    np.testing.assert_array_equal(payload.numpy(), ref_payload)  # same bytes on the wire
    # with a NaN, bit patterns of NaN may differ (torch's bf16 NaN is 0xFFFF): decode must agree
    x[17] = np.nan
    ref_payload = codec.encode(NumpyOps(), x)
    payload = codec.encode(hvd.TorchOps(), torch.from_numpy(x.copy()))
    ref = codec.decode(NumpyOps(), ref_payload, x.size)
    got = codec.decode(hvd.TorchOps(), payload, x.size).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(got[~np.isnan(got)], ref[~np.isnan(ref)])


def test_every_horovod_torch_name_is_reachable():
    public = [n for n in dir(hvd_torch) if not n.startswith("_")]
    missing = [n for n in public if not hasattr(hvd, n)]
    assert not missing, missing
    assert len(public) > 50


def test_horovods_blocking_collectives_are_under_the_stall_watchdog(monkeypatch):
    """hvd.allreduce & co. as hvdp.torch exports them: Horovod's own, each call a wait of the
    stall watchdog named after the collective and its name argument; the async forms unchanged
    (their wait is hvd.synchronize, watched)."""
    import contextlib

    from hvdp.torch import functions
    from hvdp.torch.agreement import WATCHDOG
    from hvdp.torch.watched import BLOCKING
    for n in BLOCKING:
        assert getattr(hvd, n).__wrapped__ is getattr(hvd_torch, n), n
    assert hvd.broadcast_optimizer_state.__wrapped__ is functions.broadcast_optimizer_state
    assert hvd.allreduce_async_ is hvd_torch.allreduce_async_
    seen = []

    class Entered(Exception):
        pass

    @contextlib.contextmanager
    def waiting(name):  # records the wait's name, then stops before Horovod's call runs (whether
        seen.append(name)  # or not an earlier module left Horovod initialised in this process)
        raise Entered(name)
        yield
    monkeypatch.setattr(WATCHDOG, "waiting", waiting)
    t = torch.ones(2)
    for call in (lambda: hvd.allreduce(t, name="loss"), lambda: hvd.allreduce_(t, None, "x"),
                 lambda: hvd.allgather(t), lambda: hvd.broadcast(t, 0, "w"),
                 lambda: hvd.broadcast_object({"a": 1}, 0, name="cfg"), lambda: hvd.barrier()):
        with pytest.raises(Entered):
            call()
    assert seen == ["hvd.allreduce(name='loss')", "hvd.allreduce_(name='x')", "hvd.allgather",
                    "hvd.broadcast(name='w')", "hvd.broadcast_object(name='cfg')", "hvd.barrier"]


def test_compression_members_and_horovod_compressors():
    from hvdp.torch.compression import resolve
    assert {hvd.Compression.int8.name, hvd.Compression.bf16.name, hvd.Compression.topk.name} == \
        {"int8", "bf16", "topk"}
    assert resolve(hvd_torch.Compression.fp16)[0].name == "fp16"
    assert resolve(hvd_torch.Compression.none)[0].name == "none"
    assert resolve("BF16")[0].name == "bf16"
    assert hvd.Compression.topk.configure(ratio=0.1).ratio == 0.1
    with pytest.raises(ValueError, match="valid names"):
        resolve("int3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64])
def test_compression_members_keep_horovods_compressor_contract(dtype):
    """hvd.Compression.fp16 / .none compress and decompress as Horovod's static methods do (the
    same tensors, dtypes and contexts): what hvd.allreduce(t, compression=...) calls."""
    t = (torch.from_numpy(RNG.standard_normal(33)) * 1e3).to(dtype)
    for ours, theirs in ((hvd.Compression.fp16, hvd_torch.Compression.fp16),
                         (hvd.Compression.none, hvd_torch.Compression.none)):
        (a, ca), (b, cb) = ours.compress(t), theirs.compress(t)
        assert a.dtype == b.dtype and torch.equal(a, b) and ca == cb
        back, ref = ours.decompress(a, ca), theirs.decompress(b, cb)
        assert back.dtype == ref.dtype == dtype and torch.equal(back, ref)
    assert hvd.Compression.none.compress(t)[0] is t
    assert hvd.Compression.fp16.compress(t)[0].dtype == (torch.float16 if dtype.is_floating_point else dtype)


@pytest.mark.parametrize("name", ["bf16", "int8", "topk", "auto"])
def test_two_phase_members_refuse_compress_naming_what_to_use(name):
    t = torch.ones(4)
    for call in (lambda c: c.compress(t), lambda c: c.decompress(t, torch.float32)):
        with pytest.raises(ValueError, match=f"DistributedOptimizer.*compression=hvd.Compression.{name}.*"
                                             "use hvd.Compression.fp16 or hvd.Compression.none"):
            call(getattr(hvd.Compression, name))
    with pytest.raises(TypeError, match="no framework takes a numpy.ndarray"):
        hvd.Compression.fp16.compress(np.ones(3))


@pytest.mark.timeout(600)
def test_compiled_codec_equals_reference():
    """torch.compile'd int8 (the general path, fused) gives the reference's bytes and values."""
    from hvdp.torch.compiled import CompiledCodec
    codec = codecs.get("int8", block_size=64)
    fused = CompiledCodec(codec)
    x = (RNG.standard_normal(64 * 40) * 10).astype(np.float32)
    x[5] = np.inf
    ref = codec.encode(NumpyOps(), x)
    got = fused.encode(None, torch.from_numpy(x.copy()))
    np.testing.assert_array_equal(got.numpy(), ref)
    dec = fused.decode(None, got, x.size).numpy()
    dref = codec.decode(NumpyOps(), ref, x.size)
    np.testing.assert_array_equal(np.isnan(dec), np.isnan(dref))
    np.testing.assert_array_equal(dec[~np.isnan(dec)], dref[~np.isnan(dref)])
    assert str(fused) == str(codec) and fused.payload_nbytes(128) == codec.payload_nbytes(128)


@pytest.mark.parametrize("n,size,shuffle", [(101, 3, True), (10, 4, True), (64, 2, False)])
def test_elastic_sampler_without_batch_size_is_horovods(monkeypatch, n, size, shuffle):
    """hvd.elastic.ElasticSampler(dataset): Horovod's sampler's indices on every rank, through
    record_batch(batch_idx, batch_size), a state round trip, a resize and the next epoch (world
    size and rank faked, as Horovod's own sampler reads them)."""
    import horovod.torch.elastic.sampler as hs
    world = {"rank": 0, "size": size}
    for mod in (hs, hvd_torch):
        monkeypatch.setattr(mod, "rank", lambda: world["rank"])
        monkeypatch.setattr(mod, "size", lambda: world["size"])
    data = torch.utils.data.TensorDataset(torch.arange(n))

    def both(state=None):
        out = []
        for r in range(world["size"]):
            world["rank"] = r
            ours, theirs = hvd.elastic.ElasticSampler(data, shuffle=shuffle, seed=4), \
                hs.ElasticSampler(data, shuffle=shuffle, seed=4)
            assert isinstance(ours, torch.utils.data.Sampler)
            if state is not None:
                ours.load_state_dict(state[0])
                theirs.load_state_dict(state[1])
            assert list(ours) == list(theirs) and len(ours) == len(theirs), (r, world)
            out.append((ours, theirs))
        return out

    pairs = both()
    for ours, theirs in pairs:
        for i in range(2):
            ours.record_batch(i, 2)
            theirs.record_batch(i, 2)
    state = (pairs[0][0].state_dict(), pairs[0][1].state_dict())
    world["size"] = size - 1
    pairs = both(state)
    for ours, theirs in pairs:
        ours.set_epoch(1)
        theirs.set_epoch(1)
        assert list(ours) == list(theirs)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=pairs[0][0])
    assert torch.equal(torch.cat([b[0] for b in loader]), torch.tensor(list(pairs[0][1])))
