"""A fixed training job for the bad-network matrix (tests/parallel/bad_network.py).

    bad_network_job.py flat|two-level STEPS MIN_SECONDS_PER_STEP

hvdp.torch, int8, 2 + 2 ranks on the two-node cluster, ``hierarchical=True`` for two-level.
Each rank trains an MLP on its own fixed data; each step lasts at least MIN_SECONDS_PER_STEP (a
sleep, so that a link that goes down falls inside the job; rank 0 creates the file
``$BAD_NETWORK_MARK`` at step 5, the driver's cue). Horovod's fusion is off
(HOROVOD_FUSION_THRESHOLD=0, set by the driver), so every run sums in the same order and a run
over a bad link must end bit-identical to the clean one. Prints, per rank:
'RESULT rank=<r> digest=<sha256 of the parameters> seconds=<training time> loss=<last>'."""
import hashlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from case_report import run_and_report  # noqa: E402

import hvdp.torch as hvd  # noqa: E402


def run(mode, steps, min_s, rank):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression="int8",
                                   hierarchical=(mode == "two-level"))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(1 + rank)
    x, y = torch.randn(64, 256, generator=g), torch.randint(0, 4, (64,), generator=g)
    t0 = time.time()
    mark = os.environ.get("BAD_NETWORK_MARK")  # rank 0 marks the 5th step (the link goes down then)
    for step in range(steps):
        if mark and rank == 0 and step == 5:
            open(mark, "w").close()
        t = time.time()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        time.sleep(max(0.0, min_s - (time.time() - t)))
    seconds = time.time() - t0
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(f"RESULT rank={rank} digest={digest[:16]} seconds={seconds:.2f} loss={loss.item():.6f}",
          flush=True)


if __name__ == "__main__":
    hvd.init(process_sets=hvd.hierarchical_process_sets() if sys.argv[1] == "two-level" else None)
    run_and_report(lambda case, rank: run(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), rank), None, hvd.rank())
