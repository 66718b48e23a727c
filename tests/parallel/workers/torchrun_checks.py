"""One small hvdp.torch job, run under torchrun (hvdp bootstraps Horovod's Gloo controller) and
under horovodrun: size, local and cross size (CHECK_NODES "hosts"; torchrun's LOCAL_RANK and
GROUP_RANK kept), an allreduce, an int8 DistributedOptimizer step against the
exact average within int8's bound, ranks bit-identical. Prints 'CHECK <name> OK rank=<r>' and,
on rank 0, 'LOSSES <five losses>' (compared between the launchers by the test)."""
import copy
import os
import sys

import torch

import hvdp.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reduction_bounds import check_reduced  # noqa: E402

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
nodes = int(os.environ.get("CHECK_NODES", "1"))  # the test's "hosts" (HOROVOD_HOSTNAME per node)
layout = (n, hvd.local_size(), hvd.cross_size())
assert layout == (2, 2 // nodes, nodes), layout
if "LOCAL_RANK" in os.environ:  # torchrun's numbering is kept: rank, local rank, node rank
    assert r == int(os.environ["RANK"]) and hvd.local_rank() == int(os.environ["LOCAL_RANK"])
    assert hvd.cross_rank() == int(os.environ.get("GROUP_RANK", "0")), (hvd.cross_rank(), os.environ.get("GROUP_RANK"))
print(f"CHECK size OK rank={r} size={n} local_size={hvd.local_size()} cross_size={hvd.cross_size()} "
      f"controller={'gloo' if hvd.gloo_enabled() else 'mpi'}", flush=True)

avg = hvd.allreduce(torch.tensor([float(r + 1)] * 4), name="avg")
assert torch.equal(avg, torch.full((4,), 1.5)), avg
print(f"CHECK allreduce OK rank={r}", flush=True)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
g = torch.Generator().manual_seed(1234)
x, y = torch.randn(64, 20, generator=g), torch.randint(0, 3, (64,), generator=g)
sl = slice(r * 32, (r + 1) * 32)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), compression="int8",
                               policy=hvd.CompressionPolicy(min_elements=1))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
twin = copy.deepcopy(model)
torch.nn.functional.cross_entropy(twin(x[sl]), y[sl]).backward()
torch.nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
opt.synchronize()
everyone = [hvd.allgather(q.grad.reshape(1, -1), name=f"tw.{i}") for i, q in enumerate(twin.parameters())]
per_rank = [[e[k].numpy() for e in everyone] for k in range(n)]
got = [p.grad.reshape(-1).numpy() for p in model.parameters()]
err = check_reduced(opt.engine.settings.codec, per_rank, got, opt.engine.plan.buckets)
with opt.skip_synchronize():
    opt.step()
print(f"CHECK int8_step OK rank={r} max_err={err:.3g}", flush=True)

losses = []
for _ in range(5):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x[sl]), y[sl])
    loss.backward()
    opt.step()
    losses.append(hvd.allreduce(loss.detach(), name="loss").item())
for k, p in model.named_parameters():
    allp = hvd.allgather(p.detach().reshape(1, -1), name=f"ident.{k}")
    assert torch.equal(allp[0], allp[-1]), f"{k} differs between ranks"
print(f"CHECK ranks_identical OK rank={r}", flush=True)
if r == 0:
    # one write, newline included: print() writes the line and its newline apart, and the other
    # rank's output, relayed by torchrun (and Spark), once fell between the two
    sys.stdout.write("LOSSES " + " ".join(f"{v:.9g}" for v in losses) + "\n")
    sys.stdout.flush()
hvd.shutdown()
