"""hvd.load_checkpoint (torch) loads with torch.load(weights_only=True) unless told otherwise:
hvdp's own checkpoints load that way; a file holding other objects is refused, naming the opt-out."""
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("horovod.torch")

import hvdp.torch as hvd  # noqa: E402


class Custom:
    """An ``extra`` value the safe loader does not know (it could be any code on unpickling)."""

    def __init__(self, v):
        self.v = v


@pytest.fixture(scope="module", autouse=True)
def one_worker():
    # Horovod stays up until the test process exits: a Horovod built with MPI cannot init again
    # after a shutdown in the same process (MPI_Finalize is final; Open MPI then aborts the whole
    # pytest run with exit status 1 and no summary, as a CI run did after this module's shutdown)
    hvd.init()


def model_and_opt(codec, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=codec,
                                   policy=hvd.CompressionPolicy(min_elements=1))
    return model, opt


def step(model, opt):
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


PLAIN_EXTRA = dict(epoch=3, lr=0.5, name="run-1", flag=True, nothing=None, milestones=[10, 20.5, "x"],
                   info={"a": 1, "b": [False, None], "c": {"d": "e"}}, pair=(1, 2), t=torch.arange(4.0))


@pytest.mark.parametrize("codec", ["int8", "topk", "powersgd"])
def test_own_checkpoint_loads_with_weights_only(tmp_path, codec):
    model, opt = model_and_opt(codec)
    step(model, opt)
    red = opt.engine.reducer
    assert red is not None, codec
    # one worker sends nothing, so no step leaves residuals: put some in, as a 2-worker run would
    g = torch.Generator().manual_seed(7)
    worker = {"b0": torch.randn(64, generator=g), "b1": torch.randn(32, generator=g)}
    server = {"b0": torch.randn(16, generator=g)}
    red.worker.restore(dict(worker))
    red.server.restore(dict(server))
    path = str(tmp_path / "c.pt")
    hvd.save_checkpoint(path, model, opt, **PLAIN_EXTRA)
    model2, opt2 = model_and_opt(codec, seed=9)
    extra = hvd.load_checkpoint(path, model2, opt2, weights_only=True)
    assert set(extra) == set(PLAIN_EXTRA)
    for k, v in PLAIN_EXTRA.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(extra[k], v)
        else:
            assert extra[k] == v, k
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    red2 = opt2.engine.reducer
    for got, want in ((red2.worker.snapshot(), worker), (red2.server.snapshot(), server)):
        assert sorted(got) == sorted(want)
        for k in want:
            np.testing.assert_array_equal(np.asarray(got[k]), want[k].numpy())
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["hvdp"]["step"] == s2["hvdp"]["step"]
    for p in s1["state"]:
        for k, v in s1["state"][p].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(s2["state"][p][k])), (p, k)


def test_custom_object_refused_naming_the_opt_out(tmp_path):
    model, opt = model_and_opt("int8")
    step(model, opt)
    path = str(tmp_path / "c.pt")
    hvd.save_checkpoint(path, model, opt, epoch=1, obj=Custom(41))
    model2, opt2 = model_and_opt("int8", seed=9)
    with pytest.raises(pickle.UnpicklingError, match=r"weights_only=False") as e:
        hvd.load_checkpoint(path, model2, opt2)  # the default
    assert "Custom" in str(e.value) and "trust" in str(e.value)
    extra = hvd.load_checkpoint(path, model2, opt2, weights_only=False)  # a file you trust
    assert extra["epoch"] == 1 and isinstance(extra["obj"], Custom) and extra["obj"].v == 41
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)


def test_an_empty_file_is_refused_naming_it_and_the_problem(tmp_path):
    path = tmp_path / "empty.pt"
    path.write_bytes(b"")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(EOFError, match=r"empty\.pt.*ends early \(0 bytes\).*not a complete checkpoint"):
        hvd.load_checkpoint(str(path), model)
