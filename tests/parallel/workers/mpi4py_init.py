"""Horovod inside an existing MPI program: hvd.init(comm=<mpi4py communicator>)."""
import torch
from mpi4py import MPI

import hvdp.torch as hvd

world = MPI.COMM_WORLD
hvd.init(comm=world.Dup())
assert hvd.size() == world.Get_size() and hvd.rank() == world.Get_rank(), (hvd.size(), hvd.rank())
out = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="sum")
assert out.item() == world.Get_size() * (world.Get_size() + 1) / 2
assert world.allreduce(hvd.rank()) == sum(range(world.Get_size()))  # MPI itself still usable
print(f"CHECK mpi4py OK rank={hvd.rank()}", flush=True)
