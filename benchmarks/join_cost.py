"""Per-step cost of the join control (issue 27, item 2): ``DistributedOptimizer``'s default
``uneven_inputs`` (None: on for two-phase codecs, one 1-element allreduce per step, submitted at
the first gradient hook and waited before the first two-phase bucket) against
``uneven_inputs=False`` (the default before, no control), int8, np=2, Gloo and MPI.

    python benchmarks/join_cost.py [--controllers gloo,mpi] [--pairs 200] [--report-only]

Both optimizers live in the same two processes, on two copies of one model, and take turns step
by step (the order swapped every pair, so neither always goes first); each step is timed alone
between two barriers, and a step's time is the slower rank's (it sets the pace). Reported:
median, IQR and min-max of each setting's step time, the median (IQR) of the per-pair ratio
on ÷ off and of the per-pair difference, and the ratio of the medians. Writes
``results/join_cost_<controller>.json`` and ``results/join_cost.md``.

Under horovodrun it is the job itself (``--worker``).
"""
import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RES = os.path.join(HERE, "results")


def quartiles(xs):
    """(median, q1, q3, min, max)."""
    s = sorted(xs)
    q = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else [s[0]] * 3
    return statistics.median(s), q[0], q[2], s[0], s[-1]


# --- the job (under horovodrun) -----------------------------------------------------------------
def worker(a):
    import torch

    import hvdp.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = []
    for _ in range(a.depth):
        layers += [torch.nn.Linear(a.width, a.width), torch.nn.Tanh()]
    base = torch.nn.Sequential(*layers, torch.nn.Linear(a.width, 10))
    x = torch.randn(a.batch, a.width, generator=torch.Generator().manual_seed(hvd.rank()))
    y = torch.randint(0, 10, (a.batch,), generator=torch.Generator().manual_seed(100 + hvd.rank()))

    def make(kw):
        m = copy.deepcopy(base)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1e-3),
                                       named_parameters=m.named_parameters(), compression=a.codec, **kw)

        def step():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
        return opt, step

    opt_on, on = make({})                      # the new default: uneven_inputs=None
    opt_off, off = make(dict(uneven_inputs=False))
    assert opt_on._join is not None and opt_off._join is None, "the settings did not resolve as expected"
    bucket_mb = sum(opt_on.engine.numels[i] for idx in opt_on.engine.plan.buckets for i in idx) / 1e6
    barrier = torch.zeros(1)

    def timed(step):
        hvd.allreduce(barrier, name="bench.join_cost.barrier")
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0

    for _ in range(a.warmup):
        on()
        off()
    t_on, t_off = [], []
    for i in range(a.pairs):
        if i % 2 == 0:
            t_on.append(timed(on))
            t_off.append(timed(off))
        else:
            t_off.append(timed(off))
            t_on.append(timed(on))
    # the slower rank's time per step
    every = hvd.allgather_object((t_on, t_off), name="bench.join_cost.times")
    t_on = [max(r[0][i] for r in every) for i in range(a.pairs)]
    t_off = [max(r[1][i] for r in every) for i in range(a.pairs)]
    if hvd.rank() == 0:
        stats = opt_on.compression_stats()
        out = {"size": hvd.size(), "codec": a.codec, "width": a.width, "depth": a.depth, "batch": a.batch,
               "params": sum(p.numel() for p in base.parameters()), "bucketed_elements_M": bucket_mb,
               "buckets": len(opt_on.engine.plan.buckets), "pairs": a.pairs, "warmup": a.warmup,
               "step_s": {"on": t_on, "off": t_off},
               "bytes_per_step": {k: v for k, v in stats.items() if "bytes" in k and not isinstance(v, dict)}}
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)


# --- the driver ---------------------------------------------------------------------------------
def path(controller):
    return os.path.join(RES, f"join_cost_{controller}.json")


def launch(controller, a):
    exe = shutil.which("horovodrun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    if exe is None:
        raise SystemExit("horovodrun not found")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    load0 = os.getloadavg()[0]
    cmd = [exe, "-np", "2", "-H", "localhost:2", f"--{controller}", sys.executable, os.path.abspath(__file__),
           "--worker", "--json-out", path(controller), "--pairs", str(a.pairs), "--warmup", str(a.warmup),
           "--width", str(a.width), "--depth", str(a.depth), "--batch", str(a.batch), "--codec", a.codec]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"join_cost job ({controller}) failed:\n{(r.stdout + r.stderr)[-4000:]}")
    with open(path(controller)) as f:
        res = json.load(f)
    res.update(controller=controller, load_before=load0, load_after=os.getloadavg()[0], wall_s=time.time() - t0)
    with open(path(controller), "w") as f:
        json.dump(res, f, indent=1)
    return res


def rows(res):
    on, off = res["step_s"]["on"], res["step_s"]["off"]
    ratio = quartiles([a / b for a, b in zip(on, off)])
    diff = quartiles([(a - b) * 1e3 for a, b in zip(on, off)])
    q_on, q_off = quartiles(on), quartiles(off)

    def ms(q):
        return f"{q[0] * 1e3:.2f} (IQR {q[1] * 1e3:.2f}-{q[2] * 1e3:.2f}; min-max {q[3] * 1e3:.2f}-{q[4] * 1e3:.2f})"
    c = res["controller"]
    return [(f"{c}: step time, control on (new default), ms", ms(q_on)),
            (f"{c}: step time, control off (uneven_inputs=False), ms", ms(q_off)),
            (f"{c}: per-pair ratio on ÷ off", f"{ratio[0]:.3f} (IQR {ratio[1]:.3f}-{ratio[2]:.3f}; "
                                               f"min-max {ratio[3]:.3f}-{ratio[4]:.3f})"),
            (f"{c}: per-pair difference on - off, ms", f"{diff[0]:+.2f} (IQR {diff[1]:+.2f} to {diff[2]:+.2f})"),
            (f"{c}: ratio of the medians on ÷ off", f"{q_on[0] / q_off[0]:.3f}"),
            (f"{c}: load average (1 min) before / after", f"{res['load_before']:.2f} / {res['load_after']:.2f}")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json-out")
    ap.add_argument("--controllers", default="gloo,mpi")
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    results = []
    for c in a.controllers.split(","):
        if a.report_only:
            with open(path(c)) as f:
                results.append(json.load(f))
        else:
            results.append(launch(c, a))
    r0 = results[0]
    lines = [f"Join control cost per step (issue 27): np=2 on one machine ({platform.machine()}, "
             f"{os.cpu_count()} cores), {r0['codec']}, MLP {r0['depth']}x{r0['width']} "
             f"({r0['params'] / 1e6:.2f} M parameters, {r0['bucketed_elements_M']:.2f} M elements in "
             f"{r0['buckets']} int8 bucket(s)), batch {r0['batch']}; {r0['pairs']} interleaved pairs after "
             f"{r0['warmup']} warm-up steps each, the slower rank's time per step.", "",
             "| measurement | value |", "|---|---|"]
    for res in results:
        lines += [f"| {m} | {v} |" for m, v in rows(res)]
    with open(os.path.join(RES, "join_cost.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
