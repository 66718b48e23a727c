"""hvdp.torch's wait for Horovod's collectives (hvdp.torch.waits) in a real job; run as a check
of torch_checks.py (its job)."""
import time

import torch

import hvdp.torch as hvd

LATE_S = 1.0  # how late rank 1 arrives


def _late_wait(collective):
    """Rank 1 arrives LATE_S late at ``collective()``; -> rank 0's (wall seconds, CPU seconds of
    its waiting thread), the result checked by the caller."""
    if hvd.rank() == 1:
        time.sleep(LATE_S)
    wall, cpu = time.perf_counter(), time.thread_time()
    out = collective()
    return out, time.perf_counter() - wall, time.thread_time() - cpu


def check_waits_sleep():
    """A wait on a rank that arrived first costs its thread little CPU: Horovod's own blocking
    allreduce (hvd.allreduce) and hvdp's optimizer's wait at step(). Horovod's spinning wait
    (HVDP_SLEEPING_WAIT=0) spends about the whole wait on the CPU; hvdp's must spend under a
    quarter of it. Results as without the sleeping wait: the exact sum, ranks identical."""
    out, wall, cpu = _late_wait(lambda: hvd.allreduce(torch.ones(4), name="waits.late", op=hvd.Sum))
    assert torch.equal(out, torch.full((4,), float(hvd.size()))), out
    if hvd.rank() == 0:
        assert wall > 0.5 * LATE_S, f"rank 0 did not wait ({wall:.3f} s): nothing measured"
        assert cpu < 0.25 * wall, f"hvd.allreduce's wait spent {cpu:.3f} s of CPU in {wall:.3f} s"
    model = torch.nn.Linear(64, 64)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression="int8",
                                   named_parameters=[("waits." + k, p) for k, p in model.named_parameters()])
    torch.manual_seed(hvd.rank())
    model(torch.randn(8, 64)).square().sum().backward()
    _, wall, cpu = _late_wait(opt.step)
    if hvd.rank() == 0:
        assert wall > 0.5 * LATE_S, f"rank 0's step did not wait ({wall:.3f} s): nothing measured"
        assert cpu < 0.25 * wall, f"step()'s wait spent {cpu:.3f} s of CPU in {wall:.3f} s"
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(hvd.allgather(flat.reshape(1, -1), name="waits.params")[0],
                       hvd.allgather(flat.reshape(1, -1), name="waits.params2")[-1]), "ranks differ"
