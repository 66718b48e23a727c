"""When does the shaped link carry an int4 step's bytes (issue 36: int4's step 1.5-1.75 x its
limit at 100 Mbit/s)? Rank 0 samples the namespace loopback's transmit counter every ~0.25 ms
while the GPT of overlap.py trains with int4 in 512 KiB buckets, overlap on, and logs when each
bucket's reduction starts (its last gradient in); both ranks through one 100 Mbit/s link.

    python benchmarks/link_timeline.py [--steps 25]   # -> results/link_timeline.{json,md}

Two jobs: the real GPT, and its compute emulated by sleeps (overlap.py's ``--emulate``: the
cores free, each layer's gradients all at once after that layer's share of backward). Per job,
medians over the steps after the first 5: forward, backward and step() (the tail) ms; the link
time of the bytes sent in each part (bytes ÷ the measured rate); each bucket's start in ms
after backward began; and the **release bound**: forward + the time a link at the measured rate
would finish if it sent each bucket's bytes (shared by parameters) the moment its reduction
started, in start order (a lower bound on the step: no phase latency, no decode or optimizer
step). One step's link use in 2 ms bins (F forward, B backward, S step(); 0-9: tenths of the
link's rate).
"""
import argparse
import bisect
import copy
import json
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import slowlink  # noqa: E402
from overlap import SMALL, gpt_setup  # noqa: E402
from tta import LO_TX, PEAK_LR, SEED, clip_and_step  # noqa: E402

RES = os.path.join(HERE, "results")
SKIP = 5


def worker(a):
    import numpy as np
    import torch
    import hvdp.torch as hvd
    base, data, sz, autocast, _ = gpt_setup(hvd, a.emulate)
    from torch_gpt import batch
    m = copy.deepcopy(base)
    os.environ["HVDP_OVERLAP"] = "1"
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(m.parameters(), lr=PEAK_LR, betas=(0.9, 0.95)),
                                   compression="int4", policy=hvd.CompressionPolicy(fusion_threshold_bytes=SMALL),
                                   named_parameters=list(m.named_parameters()))
    numels = [p.numel() for p in m.parameters()]
    sizes = [sum(numels[i] for i in b) for b in opt.engine.plan.buckets]
    starts, samples, events, stop = [], [], [], threading.Event()
    launch = opt._start_bucket

    def logged(b):  # when each bucket's reduction starts (its last gradient in)
        starts.append((b, time.perf_counter()))
        return launch(b)
    opt._start_bucket = logged

    def sample():
        with open(LO_TX) as f:
            while not stop.is_set():
                f.seek(0)
                samples.append((time.perf_counter(), int(f.read())))
                time.sleep(0.0002)
    if hvd.rank() == 0:
        threading.Thread(target=sample, daemon=True).start()
    for s in range(a.steps):
        rng = np.random.default_rng([SEED, s, hvd.rank()])
        x, y = batch(data, rng, sz["batch"], sz["context"])
        hvd.allreduce(torch.zeros(1), name="timeline.barrier")
        t0 = time.perf_counter()
        if a.emulate:
            opt.zero_grad()
            loss = m(None)
        else:
            import torch.nn.functional as F
            opt.zero_grad()
            with autocast():
                loss = F.cross_entropy(m(x).float().flatten(0, 1), y.flatten())
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        clip_and_step(opt, m, True)
        events.append((t0, t1, t2, time.perf_counter()))
    stop.set()
    if hvd.rank() == 0:
        with open(a.json_out, "w") as f:
            json.dump({"sizes": sizes, "starts": starts, "samples": samples, "events": events}, f)


def summarise(raw, gbit):
    ts, bs = [s[0] for s in raw["samples"]], [s[1] for s in raw["samples"]]
    rate = gbit * 1e9 / 8  # bytes per second

    def ms_of_bytes(a, b):  # the link time of the bytes sent between two instants
        i, j = max(bisect.bisect_left(ts, a) - 1, 0), min(bisect.bisect_left(ts, b), len(ts) - 1)
        return 1000 * (bs[j] - bs[i]) / rate
    sizes, rows = raw["sizes"], []
    for t0, t1, t2, t3 in raw["events"][SKIP:]:
        rel = {b: 1000 * (t - t1) for b, t in raw["starts"] if t0 <= t <= t3}
        if len(rel) != len(sizes):
            continue
        step_wire = ms_of_bytes(t0, t3 + 0.002)
        done = 0.0
        for b in sorted(rel, key=rel.get):
            done = max(done, rel[b]) + step_wire * sizes[b] / sum(sizes)
        rows.append({"fwd": 1000 * (t1 - t0), "bwd": 1000 * (t2 - t1), "tail": 1000 * (t3 - t2),
                     "step": 1000 * (t3 - t0), "wire": step_wire, "wire_bwd": ms_of_bytes(t1, t2),
                     "wire_tail": ms_of_bytes(t2, t3), "bound": 1000 * (t1 - t0) + max(done, 1000 * (t2 - t1)),
                     "starts": [rel[b] for b in range(len(sizes))]})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "starts"}
    med["starts"] = [statistics.median(r["starts"][b] for r in rows) for b in range(len(sizes))]
    t0, t1, t2, t3 = raw["events"][-1]
    bins, t = [], t0
    while t < t3:
        use = ms_of_bytes(t, t + 0.002) / 2
        bins.append(("F" if t < t1 else "B" if t < t2 else "S") + str(min(9, int(10 * use))))
        t += 0.002
    return {"median_ms": med, "steps": len(rows), "last_step_bins": " ".join(bins), "bucket_params": sizes}


def report(res):
    lines = [f"Link timeline of int4 in 512 KiB buckets, overlap on, the GPT of overlap.py, 2 workers through one "
             f"link shaped to 100 Mbit/s (measured {res['gbit'] * 1000:.0f} Mbit/s); medians of "
             f"{res['real']['steps']} steps. The run took {res['took_s'] / 60:.1f} min.", "",
             "| job | step ms | forward | backward | step() | link ms of the step's bytes | during backward "
             "| during step() | release bound ms | step ÷ bound |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key, name in (("real", "the GPT"), ("emulated", "compute emulated (cores free)")):
        m = res[key]["median_ms"]
        cells = [m[k] for k in ("step", "fwd", "bwd", "tail", "wire", "wire_bwd", "wire_tail", "bound")]
        lines.append(f"| {name} | " + " | ".join(f"{v:.0f}" for v in cells) + f" | {m['step'] / m['bound']:.2f} |")
    lines += ["", "Each bucket's reduction starts (ms after backward began; parameters per bucket "
              f"{res['real']['bucket_params']}):", ""]
    for key in ("real", "emulated"):
        lines.append(f"- {key}: " + ", ".join(f"{s:.0f}" for s in res[key]["median_ms"]["starts"]))
    lines += ["", "The last step's link use in 2 ms bins (F forward, B backward, S step(); 0-9 tenths of the rate):",
              ""]
    for key in ("real", "emulated"):
        lines += [f"- {key}: `{res[key]['last_step_bins']}`"]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--emulate", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    why = slowlink.unavailable("100mbit")
    if why:
        raise SystemExit(f"link_timeline.py needs a shaped link: {why}")
    res, t0 = {}, time.time()
    with slowlink.link("100mbit", isolate=True) as (prefix, gbit):
        for key, extra in (("real", []), ("emulated", ["--emulate"])):
            raw = slowlink.run_job(prefix, "link_timeline.py", ["--worker", "--steps", str(a.steps)] + extra,
                                   timeout=900)
            res[key] = summarise(raw, gbit)
    res["gbit"], res["took_s"] = gbit, time.time() - t0
    md = report(res)
    print(md)
    os.makedirs(RES, exist_ok=True)
    with open(os.path.join(RES, "link_timeline.json"), "w") as f:
        json.dump(res, f)
    with open(os.path.join(RES, "link_timeline.md"), "w") as f:
        f.write(md)


if __name__ == "__main__":
    main()
