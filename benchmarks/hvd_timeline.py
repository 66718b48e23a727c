"""Where a step's collectives spend their time, from Horovod's own timeline (issue 36, item 1).

    python benchmarks/hvd_timeline.py [--rate none|100mbit] [--steps 30]
    # -> results/hvd_timeline_<rate>.{json,md}

One job under ``horovodrun --gloo`` (2 workers; a throttled ``--rate`` in a network namespace,
needs root) trains tta.py's GPT with hvdp int4 in 512 KiB buckets (seven buckets, each an alltoall
then an allgather) and hvdp none, taking turns step by step, with ``HOROVOD_TIMELINE`` set: rank 0
then records, for every collective, its negotiation (from the first rank's request to the
coordinator's go) and its processing (the op and its activities: memory copies, the Gloo
transfer). The report gives, per method and kind of collective, the wall time per step covered
by the negotiations (**negotiate**: from the first rank's request to the go, so it includes
waiting for the slower rank and for the background thread's next cycle) and by the ops (**op**:
rank 0's execution, which includes waiting inside Gloo for a peer that starts it later), the
number of collectives per step, and the wall time covered by all of the method's ops, beside the
step time the worker measured.

A reading aid, not a target: the timeline is rank 0's view, and writing it costs time.
"""
import argparse
import collections
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import slowlink  # noqa: E402
from tta import SMALL_BUCKETS  # noqa: E402

RES = os.path.join(HERE, "results")
METHODS = (("hvdp int4 (512 KiB buckets)", "int4", SMALL_BUCKETS), ("hvdp none", "none", None))


def load_events(path):
    """Horovod's timeline (a JSON array that may lack its closing bracket) -> its events."""
    with open(path) as f:
        text = f.read().strip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    return json.loads(text)


def spans(events):
    """{tensor name: [(phase name, start us, end us, [(activity, start, end)])]} from the
    timeline's B/E pairs: a top-level span (NEGOTIATE_* or the op) holds its nested activities."""
    names, stack, out = {}, collections.defaultdict(list), collections.defaultdict(list)
    for e in events:
        pid, ph = e.get("pid"), e.get("ph")
        if ph == "M" and e.get("name") == "process_name" and "name" in e.get("args", {}):
            names[pid] = e["args"]["name"]  # "<op>.<tensor name>"
        elif ph == "B":
            stack[pid].append([e.get("name", ""), e["ts"], []])
        elif ph == "E" and stack[pid]:
            name, t0, acts = stack[pid].pop()
            if stack[pid]:
                stack[pid][-1][2].append((name, t0, e["ts"]))
            else:
                out[names.get(pid, str(pid))].append((name, t0, e["ts"], acts))
    return out


def kind_of(tensor):
    """A collective's kind: the timeline's op prefix ("alltoall.hvdp.opt0.hvdp.a2a.b0"); the
    step's presence and join sums (hvdp#present, hvdp.join.*) are "control"."""
    if "#" in tensor or ".join." in tensor:
        return "control"
    return tensor.split(".", 1)[0]


def covered(intervals):
    """Total length of the union of (start, end) intervals (fused tensors share one op's span)."""
    total, end = 0.0, None
    for t0, t1 in sorted(intervals):
        if end is None or t0 > end:
            total, end = total + (t1 - t0), t1
        elif t1 > end:
            total, end = total + (t1 - end), t1
    return total


def summarise(by_tensor, steps, step_times):
    """Per method and kind: wall ms per step covered by negotiations and by ops (the union of their
    spans: tensors fused into one op share it), collectives per step; activities likewise."""
    out = {}
    for i, (label, _, _) in enumerate(METHODS):  # the worker makes the optimizers in this order
        mine = {t: v for t, v in by_tensor.items() if f".hvdp.opt{i}." in t}
        neg, ops, acts = (collections.defaultdict(list) for _ in range(3))
        for tensor, phases in mine.items():
            k = kind_of(tensor)
            for name, t0, t1, nested in phases:
                if name.startswith("NEGOTIATE"):
                    neg[k].append((t0, t1))
                else:
                    ops[k].append((t0, t1))
                    for a, a0, a1 in nested:
                        acts[a].append((a0, a1))
        n = max(1, steps)
        out[label] = {"kinds": {k: {"negotiate_ms": covered(neg[k]) / 1e3 / n, "op_ms": covered(ops[k]) / 1e3 / n,
                                    "count": len(ops[k]) / n} for k in ops},
                      "all_ops_ms": covered([iv for v in ops.values() for iv in v]) / 1e3 / n,
                      "activities_ms": {a: covered(v) / 1e3 / n
                                        for a, v in sorted(acts.items(), key=lambda kv: -covered(kv[1]))},
                      "step_ms": 1e3 * statistics.median(step_times[label]) if step_times.get(label) else None}
    return out


def worker(a):
    import copy
    import time

    import numpy as np
    import torch

    import hvdp.torch as hvd
    import tta
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    from torch_gpt import GPT, batch
    from workload_data import stdlib_corpus

    sz = tta.SIZES["full"]
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = GPT(sz["layers"], sz["d_model"], sz["heads"], sz["context"])
    train_data, _ = stdlib_corpus()
    runs = []
    for label, codec, buckets in METHODS:
        m = copy.deepcopy(base)
        key = label.split(" (")[0].replace(" ", "_") + ("_small" if buckets else "")
        policy = hvd.CompressionPolicy(fusion_threshold_bytes=buckets) if buckets else None
        opt = hvd.DistributedOptimizer(torch.optim.AdamW(m.parameters(), lr=tta.PEAK_LR), compression=codec,
                                       policy=policy, named_parameters=[(f"tl.{key}.{k}", p)
                                                                        for k, p in m.named_parameters()])
        runs.append((label, m, opt))
    times = {label: [] for label, _, _ in runs}

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    for step in range(a.steps):
        for label, m, opt in runs:
            rng = np.random.default_rng([0, step, hvd.rank()])
            x, y = batch(train_data, rng, sz["batch"], sz["context"])
            hvd.barrier()
            t0 = time.perf_counter()
            tta.train_step(opt, m, m, x, y, autocast, True)
            times[label].append(time.perf_counter() - t0)
    if hvd.rank() == 0:
        with open(a.json_out, "w") as f:
            json.dump({"times": {k: v[5:] for k, v in times.items()}, "steps": a.steps}, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="none")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--timeline", help="keep Horovod's timeline file here (default: a temporary one)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    why = slowlink.unavailable(a.rate, isolate=a.rate != "none")
    if why:
        raise SystemExit(f"hvd_timeline: {why}")

    def run():
        with tempfile.TemporaryDirectory() as tmp:
            tl = a.timeline or os.path.join(tmp, "timeline.json")
            os.environ["HOROVOD_TIMELINE"] = tl
            with slowlink.link(a.rate, isolate=a.rate != "none") as (prefix, gbit):
                res = slowlink.run_job(prefix, "hvd_timeline.py", ["--worker", "--steps", str(a.steps)],
                                       timeout=900)
            del os.environ["HOROVOD_TIMELINE"]
            by_tensor = spans(load_events(tl))
        # the first 5 steps are left out of the worker's times; the timeline holds every step
        return {"rate": a.rate, "measured_gbit_s": gbit, "steps": a.steps,
                "methods": summarise(by_tensor, a.steps, res["times"])}
    stem = os.path.join(RES, f"hvd_timeline_{a.rate}")
    md = report(slowlink.saved_or_run(stem, False, run))
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)


def report(out):
    lines = [f"Horovod's timeline (rank 0), tta.py's GPT, 2 workers, link {out['rate']} "
             f"(measured {out['measured_gbit_s']:.3f} Gbit/s), {out['steps']} steps per method in turns; wall ms "
             "per step covered by the spans (their union: fused tensors share one op), over every step (the "
             "first included); step: the worker's median, first 5 steps left out.",
             "", "| method | step ms | every op's span ms | kind | collectives / step | negotiate ms / step "
             "| op ms / step |", "|---|---|---|---|---|---|---|"]
    for label, m in out["methods"].items():
        for kind, r in m["kinds"].items():
            lines.append(f"| {label} | {m['step_ms']:.0f} | {m['all_ops_ms']:.1f} | {kind} | {r['count']:.1f} "
                         f"| {r['negotiate_ms']:.1f} | {r['op_ms']:.1f} |")
    lines += ["", "| method | activity | ms / step |", "|---|---|---|"]
    for label, m in out["methods"].items():
        for act, ms in list(m["activities_ms"].items())[:8]:
            lines.append(f"| {label} | {act} | {ms:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
