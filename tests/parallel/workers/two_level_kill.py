"""A rank SIGKILLed inside a two-level reduction (tests/parallel/test_two_node.py).

    two_level_kill.py KILLED_RANK

hvdp.torch on two nodes of two ranks, ``hierarchical=True`` with int8 (the process sets
registered at hvd.init). From step 3 on, rank KILLED_RANK kills itself (SIGKILL: no report, no
exit handler) right after its backward pass, that is with its buckets' reductions submitted and
the other ranks inside them. Every other rank must end with hvdp's message, a Python exception
(case_report's 'ERROR rank=<r> ...' line), not a C++ abort."""
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from case_report import run_and_report  # noqa: E402

import hvdp.torch as hvd  # noqa: E402


def run(killed, rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression="int8",
                                   hierarchical=True)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    torch.manual_seed(1 + rank)
    x, y = torch.randn(32, 512), torch.randint(0, 4, (32,))
    for step in range(100):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if rank == killed and step == 3:
            print(f"KILLING rank={rank} step={step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()


if __name__ == "__main__":
    hvd.init(process_sets=hvd.hierarchical_process_sets())
    run_and_report(run, int(sys.argv[1]), hvd.rank())
