"""compression_stats() in hvdp.keras against a traced/eager twin and against hvdp.torch; run as a
check of keras_checks.py (its job, its helpers)."""
import keras

import hvdp.keras as hvd
from keras_checks import LOSS, TF, data, make_model

if not TF:
    import torch

STAT_KEYS = {"last_step", "total", "steps", "phase_ms", "phase_ms_last_step", "paths", "paths_why",
             "codec", "compressed_tensors", "plain_tensors", "hierarchical", "not_counted"}
ROW_KEYS = ("tensors", "elements", "handed", "sent", "fp32")


def _rows(stats):
    return {part: {c: {k: v[k] for k in ROW_KEYS if k in v} for c, v in stats[part].items()}
            for part in ("last_step", "total")}


def check_stats_shape(steps=3, warmup=1):
    """compression_stats() has hvdp.torch's shape, recorded: a traced step (TF) counts the same
    bytes as eager steps; on the torch backend, the same figures as hvdp.torch on the same model."""
    x, y = data(steps * hvd.size() * 8, seed=5)
    xs, ys = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    pol = hvd.CompressionPolicy(min_elements=64, warmup_steps=warmup)
    got = {}
    for eager in (False, True):
        model = make_model()
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="int8", policy=pol)
        model.compile(optimizer=opt, loss=LOSS, run_eagerly=eager)
        model.fit(xs, ys, batch_size=8, epochs=1, shuffle=False, verbose=0)
        got[eager] = opt.compression_stats()
        assert set(got[eager]) == STAT_KEYS, set(got[eager]) ^ STAT_KEYS
        assert got[eager]["steps"] == steps, got[eager]
    assert _rows(got[False]) == _rows(got[True]), (got[False], got[True])
    assert set(got[True]["total"]) == {"int8", "none", "all"}, got[True]["total"]
    if TF:
        return
    import hvdp.torch as thvd
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    topt = thvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                     named_parameters=net.named_parameters(), compression="int8", policy=pol)
    xt, yt = torch.from_numpy(xs), torch.from_numpy(ys).long()
    for i in range(steps):
        topt.zero_grad()
        torch.nn.functional.cross_entropy(net(xt[8 * i:8 * (i + 1)]), yt[8 * i:8 * (i + 1)]).backward()
        topt.step()
    ts = topt.compression_stats()
    assert set(ts) == STAT_KEYS, set(ts) ^ STAT_KEYS
    assert _rows(ts) == _rows(got[True]), (ts, got[True])
    assert (ts["compressed_tensors"], ts["plain_tensors"]) == (got[True]["compressed_tensors"],
                                                               got[True]["plain_tensors"])
