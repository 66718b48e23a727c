"""Two ranks that differ in one detail (the case named on the command line), 3 steps each.

Every rank prints 'ERROR rank=<r> type=<T> msg=<json>' for the exception that ends it, then
lets it propagate (so hvdp's exception hook and the job's exit code see it), or 'DONE rank=<r>'.
"""
import os
import signal
import sys
import time

import torch

import hvdp.torch as hvd
from case_report import run_and_report, run_cases, stalled_call


def model_for(case, rank):
    torch.manual_seed(0)
    hidden = 48 if (case.startswith("wider") and rank == 1) else 32
    layers = [torch.nn.Linear(2048, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 4)]
    if case.startswith("extra") and rank == 1:  # a layer built only on one rank
        layers += [torch.nn.Tanh(), torch.nn.Linear(4, 4)]
    return torch.nn.Sequential(*layers)


def settings_for(case, rank):
    kw = {"compression": "int8" if case.endswith("int8") else "none"}
    if rank == 1:
        if case == "codec":
            kw["compression"] = "int8"
        elif case == "bpps":
            kw["backward_passes_per_step"] = 2
        elif case == "policy":
            kw["policy"] = hvd.CompressionPolicy(exclude=("*.bias",))
        elif case == "hierarchical":  # the check comes before the two levels' own collectives
            kw["hierarchical"] = True
    return kw


class FailingDecode:
    """rank 1's codec raises in the middle of a reduction (in synchronize, after the alltoall)."""

    def __init__(self, inner, at_call):
        self.inner, self.calls, self.at_call = inner, 0, at_call

    def __getattr__(self, k):
        return getattr(self.inner, k)

    def decode(self, ops, payload, n):
        self.calls += 1
        if self.calls >= self.at_call:
            raise ValueError("injected failure: rank 1's decoder broke")
        return self.inner.decode(ops, payload, n)


def run(case, rank):
    if case == "stall_user":  # rank 1 never reaches the script's own hvd.allreduce
        return stalled_call(rank, lambda: hvd.allreduce(torch.ones(1), name="user.loss"))
    model = model_for(case, rank)
    x, y = torch.randn(16, 2048), torch.randint(0, 4, (16,))
    if case == "broadcast":
        extra = {"extra.weight": torch.zeros(3)} if rank == 1 else {}
        hvd.broadcast_parameters(dict(model.state_dict(), **extra), root_rank=0)
        return
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), **settings_for(case, rank))
    if case == "fail_int8" and rank == 1:
        # the failure is injected into the codec's decode, which the fused kernels bypass
        os.environ["HVDP_KERNELS"] = "off"
        red = opt.engine.reducer
        red = getattr(red, "inner", red)  # under the join control (the default) the two-phase reducer is inside
        red.codec = FailingDecode(red.codec, at_call=3)
    for step in range(3):
        if case == "early_exit" and rank == 1:
            return  # e.g. a rank whose data ran out: it never calls step()
        if case == "kill" and rank == 1 and step == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # e.g. the OOM killer: no report, no dump
        if case == "unheard" and rank == 1 and step == 1:
            # its Horovod shutdown hangs (seen rarely in the no_step case, under MPI and Gloo): after
            # shutdown_s it ends the process; rank 0's wait must end before, with this rank named
            # (its watchdog reads the board's "ending")
            from hvdp.torch.agreement import REPORTER
            REPORTER._shutdown, REPORTER.shutdown_s = (lambda: time.sleep(60)), 6.0
            raise ValueError("unheard: rank 1 failed while Horovod stays up")
        if case == "stall" and rank == 1 and step == 1:
            time.sleep(float(os.environ.get("STALL_S", "120")))  # e.g. a long evaluation on one rank only
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if case == "no_step" and rank == 1:
            continue  # forgets step(): the next zero_grad / backward refuses
        opt.step()


def main():
    case = sys.argv[1]
    # torch's first optimizer pays seconds of lazy imports: keep them out of the time measured
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    hvd.init()
    if case == "cases":  # disagree_torch.py cases <case> <case> ...: one job, each case reported
        barrier = iter(range(1 << 30))
        run_cases(run, sys.argv[2:], hvd.rank(),
                  lambda: hvd.allreduce(torch.zeros(1), name=f"cases.barrier.{next(barrier)}"))
        return
    run_and_report(run, case, hvd.rank())


if __name__ == "__main__":
    main()
