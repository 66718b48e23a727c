"""A Horovod PyTorch training script in the usual style; the import line is its only change."""
import torch
import torch.nn.functional as F
import torch.utils.data.distributed

import hvdp.torch as hvd  # was: import horovod.torch as hvd

hvd.init()
torch.manual_seed(42)
torch.set_num_threads(1)
if torch.cuda.is_available():
    torch.cuda.set_device(hvd.local_rank())

g = torch.Generator().manual_seed(0)
x = torch.randn(512, 10, generator=g)
y = (x[:, :3].sum(1) > 0).long()
dataset = torch.utils.data.TensorDataset(x, y)
sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)

model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.fp16, op=hvd.Average)


def metric_average(val, name):
    return hvd.allreduce(torch.tensor(val), name=name).item()


first = None
for epoch in range(5):
    sampler.set_epoch(epoch)
    total = 0.0
    for data, target in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        total += loss.item()
    avg = metric_average(total / len(loader), "avg_loss")
    first = avg if first is None else first
    if hvd.rank() == 0:
        print(f"epoch {epoch} loss {avg:.4f}", flush=True)
assert avg < first, (first, avg)
print(f"CHECK horovod_style OK rank={hvd.rank()}", flush=True)
