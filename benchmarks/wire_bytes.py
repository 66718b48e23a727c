"""Wire bytes accounted: per codec, the bytes one worker puts on the wire per step (the loopback
counter of an isolated network namespace, 2 workers under ``horovodrun --gloo``) against what
``compression_stats()`` reports, itemised.

    python benchmarks/wire_bytes.py [--runs 3] [--steps 12] [--codecs none,bf16,int8,int4,powersgd4] [--width 0]

Items, each per step per worker (the counter counts both workers: halved):
- ``stats``: ``compression_stats()["last_step"]["all"]["sent"]`` (ring / pairwise formulas on the
  buffers handed to the collectives, small tensors' float32 allreduce included);
- ``tcp_ip``: the steps' packets x 66 bytes (Ethernet 14 + IPv4 20 + TCP with timestamps 32:
  the loopback counts whole frames);
- ``coordination``: the steps' packets x the TCP payload per packet of an idle interval as long
  as the steps (Horovod's background cycle alone: its per-cycle negotiation messages);
- ``remainder``: measured − the three (Gloo's message framing, Horovod's per-collective
  negotiation, hvdp's control collectives, anything not accounted).

Each run is one job; the report fits the rate of what ``sent`` leaves out, (measured − stats) ÷
step time, over every codec and run: the figure behind ``compression_stats()["not_counted"]``
(``hvdp.reduce.stats.UNCOUNTED_BYTES_PER_S``). Writes ``benchmarks/results/wire_bytes.{json,md}``.
Needs root (a network namespace); the namespace is deleted afterwards.
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LO = "/sys/class/net/lo/statistics/"
HEADER = 66  # bytes per loopback frame beyond the TCP payload: Ethernet 14 + IPv4 20 + TCP 32


def counters():
    with open(LO + "tx_bytes") as f, open(LO + "tx_packets") as g:
        return int(f.read()), int(g.read())


def worker(a):
    import numpy as np
    import torch
    import torch.nn.functional as F

    import hvdp.torch as hvd
    from hvdp import codecs
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    from torch_gpt import GPT, batch
    from workload_data import stdlib_corpus

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = GPT(4, 128, 4, 128) if not a.width else torch.nn.Sequential(
        torch.nn.Linear(a.width, a.width), torch.nn.ReLU(), torch.nn.Linear(a.width, 10))
    data, _ = stdlib_corpus()
    fence = torch.zeros(1)

    def sync():
        hvd.allreduce(fence, name="wire.fence")

    def window(fn):
        sync()
        b0, p0 = counters()
        t0 = time.perf_counter()
        fn()
        sync()
        dt = time.perf_counter() - t0
        b1, p1 = counters()
        return (b1 - b0) / hvd.size(), (p1 - p0) / hvd.size(), dt

    out = {"world": hvd.size(), "params": sum(p.numel() for p in base.parameters()), "steps": a.steps, "codecs": {}}
    for label in a.codecs.split(","):
        codec = codecs.get("powersgd").configure(rank=int(label[8:])) if label.startswith("powersgd") else label
        m = copy.deepcopy(base)
        opt = hvd.DistributedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), compression=codec,
                                       named_parameters=[(f"{label}.{k}", p) for k, p in m.named_parameters()])
        rng = np.random.default_rng([0, hvd.rank()])

        def step():
            opt.zero_grad()
            if a.width:
                x = torch.randn(16, a.width)
                loss = F.cross_entropy(m(x), torch.randint(0, 10, (16,)))
            else:
                x, y = batch(data, rng, 16, 128)
                loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()

        for _ in range(3):  # layout, ranks-agree check, auto's probe if any: not the steady state
            step()
        sent = []

        def steps():
            for _ in range(a.steps):
                step()
                sent.append(opt.compression_stats()["last_step"]["all"]["sent"])

        nbytes, npk, dt = window(steps)
        idle_b, idle_p, idle_dt = window(lambda: time.sleep(dt))
        k = a.steps
        measured = nbytes / k
        stats = sum(sent) / k
        nc = opt.compression_stats()["not_counted"]
        tcp_ip = npk * HEADER / k
        coordination = npk * max(idle_b / max(idle_p, 1) - HEADER, 0.0) / k
        out["codecs"][label] = {
            "measured": measured, "stats": stats, "coordination": coordination, "tcp_ip": tcp_ip,
            "remainder": measured - stats - coordination - tcp_ip, "packets": npk / k, "idle_packets": idle_p / k,
            "step_s": dt / k, "idle_s": idle_dt / k, "fp32": opt.compression_stats()["last_step"]["all"]["fp32"],
            "tensors": opt.compression_stats()["last_step"],
            "idle": idle_b / k,
            "not_counted_estimate": (dt / k) * nc["bytes_per_s"], "not_counted": nc}
        opt.remove_hooks() if hasattr(opt, "remove_hooks") else None
    if hvd.rank() == 0:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)


def table(res):
    mb = 1e6
    rows = ["| codec | measured MB | stats `sent` MB | coordination (idle) | TCP/IP headers | remainder | "
            "stats / measured | stats + not_counted estimate / measured |", "|---" * 8 + "|"]
    rows[0] = rows[0].replace("coordination (idle)", "Horovod coordination")
    for c, r in res["codecs"].items():
        est = r["not_counted_estimate"]
        rows.append(f"| {c} | {r['measured'] / mb:.3f} | {r['stats'] / mb:.3f} | {r['coordination'] / mb:.4f} | "
                    f"{r['tcp_ip'] / mb:.4f} | {r['remainder'] / mb:+.4f} ({r['remainder'] / r['measured']:+.1%}) | "
                    f"{r['stats'] / r['measured']:.3f} | {(r['stats'] + est) / r['measured']:.3f} |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", default=os.path.join(HERE, "results", "wire_bytes.json"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--runs", type=int, default=3, help="jobs, one after another (the rate's spread)")
    ap.add_argument("--codecs", default="none,bf16,int8,int4,powersgd4")
    ap.add_argument("--width", type=int, default=0, help="a 2-layer MLP of this width instead of the GPT")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    sys.path.insert(0, HERE)
    import slowlink
    why = slowlink.unavailable("none", isolate=True)
    if why:
        raise SystemExit(f"wire_bytes needs an isolated namespace: {why}")
    args = ["--worker", "--steps", str(a.steps), "--codecs", a.codecs, "--width", str(a.width)]
    t0 = time.time()
    runs = []
    with slowlink.link("none", isolate=True) as (prefix, _):
        for _ in range(a.runs):
            runs.append(slowlink.run_job(prefix, "wire_bytes.py", args, timeout=600))
    res = dict({k: runs[0][k] for k in ("world", "params", "steps")}, runs=runs, wall_s=time.time() - t0,
               cycle=slowlink.horovod_cycle(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    with open(a.json_out, "w") as f:
        json.dump(res, f, indent=1)
    md = os.path.splitext(a.json_out)[0] + ".md"
    with open(md, "w") as f:
        f.write(report(res) + "\n")
    print(report(res))


def report(res) -> str:
    """One table per run and the fitted rate of what ``sent`` leaves out."""
    from hvdp.reduce.stats import UNCOUNTED_BYTES_PER_S
    rates = [(r["measured"] - r["stats"]) / r["step_s"] for run in res["runs"] for r in run["codecs"].values()]
    rate = statistics.median(rates)
    fits = [(r["stats"] + rate * r["step_s"]) / r["measured"] for run in res["runs"] for r in run["codecs"].values()]
    out = [f"# Wire bytes per step per worker ({res['date']}, {res['world']} workers, {res['params']:,} parameters, "
           f"{res['steps']} steps per codec, {len(res['runs'])} runs, `benchmarks/wire_bytes.py`; Horovod's cycle: "
           f"{res['cycle']})", ""]
    for i, run in enumerate(res["runs"]):
        out += [f"Run {i + 1}:", "", table(run), ""]
    out.append(f"What `sent` leaves out, (measured − stats) ÷ step time, over {len(rates)} codec runs: median "
               f"{rate / 1e3:.0f} KB/s per worker (min {min(rates) / 1e3:.0f}, max {max(rates) / 1e3:.0f}); "
               f"`not_counted` uses {UNCOUNTED_BYTES_PER_S / 1e3:.0f} KB/s (the last column). With the median "
               f"rate, stats + estimate / measured spans {min(fits):.3f}-{max(fits):.3f}.")
    return "\n".join(out)


if __name__ == "__main__":
    main()
