"""Flat against two-level reduction past this machine: a cost model checked on the two-node
cluster, then carried to GPU clusters of 8 GPUs per node and 2-128 nodes.

    python benchmarks/project_scale.py [--report-only]

1. **Measured lines.** On the two-node cluster (MPI, 1 Gbit/s between the nodes, 2 ranks per
   node) ``two_level_probe.py`` fits ``hvdp.reduce.auto``'s A + B·x lines (``hvdp.reduce.probe``) for the
   collectives of the whole job, of one node and of one cross set (one rank per node), each
   codec's work, and a step's compute alone.
2. **Checked.** The model (below) predicts each method's step time on those 4 ranks from the
   lines; ``results/two_level_mpi_1gbit.json`` (``two_level.py``) has the measured medians. The
   prediction error is in the table (target: within 20%).
3. **Projected.** The same model with lines made from stated link figures (every assumption in
   ``ASSUMPTIONS``) for a 1B-parameter model: predicted step time of flat and two-level
   reduction per codec, a table and a plot (``results/project_scale.png``).

The model of one step (n_b elements per bucket b; P ranks, L per node, C nodes):

- compute + for each bucket:
- flat ``none`` (and Horovod's allreduce): ``allreduce.float32(4 n_b)`` over the job;
- flat two-phase codec: ``alltoall(P·pay) + allgather(pay) + codec(n_b)`` over the job, pay the
  codec's payload of a chunk ceil(n_b / P);
- two-level: ``alltoall_local(4 L s) + allgather_local(4 s)`` (float32 inside the node, s =
  ceil(n_b / L)) + the cross step on s over C ranks: ``allreduce.float32(4 s)`` for none, the
  two-phase terms for a codec. No overlap of anything with anything (the model errs slow).
"""
import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RES = os.path.join(HERE, "results")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "parallel"))

from hvdp import codecs  # noqa: E402
from hvdp.reduce.auto import CostTable, Line  # noqa: E402
from hvdp.reduce.twophase import chunk_length  # noqa: E402

METHODS = {"horovod": ("none", False), "none": ("none", False), "none 2L": ("none", True),
           "bf16 2L": ("bf16", True), "int8": ("int8", False), "int8 2L": ("int8", True)}
ERROR_TARGET = 0.20

ASSUMPTIONS = {
    "model": "1B parameters, float32 gradients (4 GB per step), fused into 64 MiB buckets",
    "compute_s": 0.25,  # per step: 6 x 1e9 x 16k tokens per GPU at ~400 TFLOP/s sustained
    "compute": "0.25 s per step per GPU (6 * 1e9 params * 16,384 tokens / 4e14 FLOP/s), never overlapped "
               "with the reduction (the model errs slow for every method alike)",
    "gpus_per_node": 8,
    "nvlink": "450 GB/s per GPU per direction inside a node (NVLink 4), 10 us per collective",
    "inter_node": "one link per node of the stated rate, shared by the node's 8 GPUs; 10 us per "
                  "collective on InfiniBand, 30 us on Ethernet",
    "flat ring": "NCCL-style ring allreduce: each node's link carries one ring edge each way",
    "flat alltoall": "each GPU's chunks for the P - L GPUs on other nodes cross its node's link",
    "flat allgather": "ring: each node's link carries (P - 1) parts each way",
    "codecs": "per element as measured on the H200 (results/cuda_codecs_h200.json: int8 with error "
              "feedback encode+decode and the owner's decode-sum, Triton; bf16 cast there and back)",
}
LINKS = {"25 GbE": (25e9 / 8, 30e-6), "100 Gb/s IB": (100e9 / 8, 10e-6), "400 Gb/s IB": (400e9 / 8, 10e-6)}
NVLINK = (450e9, 10e-6)
NODES = (2, 4, 8, 16, 32, 64, 128)


# --- the model --------------------------------------------------------------------------------
def two_phase(table: CostTable, codec, n: int) -> float:
    p = table.world
    pay = codec.payload_nbytes(chunk_length(n, p, codec.align))
    return table.links["alltoall"](p * pay) + table.links["allgather"](pay) + table.compute[str(codec)](n)


def predict(method, buckets, compute_s, world: CostTable, local: CostTable, cross: CostTable) -> float:
    """Seconds per step of ``method`` (a METHODS key) by the model of the module's docstring."""
    name, hier = METHODS[method]
    codec = codecs.get(name)
    t = compute_s
    for n in buckets:
        if not hier:
            t += world.links["allreduce.float32"](4 * n) if codec.summable else two_phase(world, codec, n)
            continue
        s = chunk_length(n, local.world, codec.align)
        t += local.links["alltoall"](4 * s * local.world) + local.links["allgather"](4 * s)
        t += cross.links["allreduce.float32"](4 * s) if codec.summable else two_phase(cross, codec, s)
    return t


# --- lines from stated figures ----------------------------------------------------------------
def stated_tables(nodes: int, link: str, gpu_codecs: dict):
    """(world, local, cross) CostTables for ``nodes`` x 8 GPUs from the stated link figures.

    Each line's x is what ``hvdp.reduce.probe`` measures: the buffer for allreduce, the whole send
    buffer (P chunks) for alltoall, this rank's part for allgather."""
    per_gpu = ASSUMPTIONS["gpus_per_node"]
    p = nodes * per_gpu
    bx, ax = LINKS[link]
    bn, an = NVLINK
    world = {"allreduce.float32": Line(ax, 2 * (p - 1) / p / bx),
             "alltoall": Line(ax, max(per_gpu * (p - per_gpu) / p / bx, (per_gpu - 1) / p / bn)),
             "allgather": Line(ax, (p - 1) / bx)}
    local = {"allreduce.float32": Line(an, 2 * (per_gpu - 1) / per_gpu / bn),
             "alltoall": Line(an, (per_gpu - 1) / per_gpu / bn), "allgather": Line(an, (per_gpu - 1) / bn)}
    share = bx / per_gpu  # the node's 8 cross sets run at once over one link
    cross = {"allreduce.float32": Line(ax, 2 * (nodes - 1) / nodes / share),
             "alltoall": Line(ax, (nodes - 1) / nodes / share), "allgather": Line(ax, (nodes - 1) / share)}
    return (CostTable(p, world, gpu_codecs), CostTable(per_gpu, local, gpu_codecs),
            CostTable(nodes, cross, gpu_codecs))


def gpu_codec_lines() -> dict:
    """Per-element codec work on the H200 (a rank's whole work on a bucket: two encode+decode
    passes and the owner's decode-sum, as the two-phase reduction runs it)."""
    with open(os.path.join(RES, "cuda_codecs_h200.json")) as f:
        h = json.load(f)
    big = max(h["sizes"], key=lambda s: s["mib"])
    elements = big["mib"] * 2 ** 20 / 4
    rows = big["rows"]
    int8 = (2 * rows["int8 + EF encode+decode (triton)"]["ms"] + rows["owner decode-sum P=4 (triton)"]["ms"]) / 1e3
    bf16 = 2 * rows["bf16 cast there and back (torch)"]["ms"] / 1e3
    return {str(codecs.get("int8")): Line(0.0, int8 / elements), str(codecs.get("bf16")): Line(0.0, bf16 / elements)}


# --- stages -----------------------------------------------------------------------------------
def probe(out_json):
    from two_node import TwoNodeCluster
    why = TwoNodeCluster.unavailable()
    if why:
        return {"skipped": why}
    with TwoNodeCluster(rate="1gbit") as c:
        r = c.run(c.horovodrun("mpi") + [sys.executable, os.path.join(HERE, "two_level_probe.py"),
                                         "--json-out", out_json], timeout=900)
        if r.returncode != 0:
            raise SystemExit(f"two_level_probe failed:\n{r.stdout[-4000:]}")
    with open(out_json) as f:
        return json.load(f)


def check_rows(pr, measured):
    tables = {k: CostTable.from_dict(v) for k, v in pr["tables"].items()}
    out = []
    for m, v in measured["methods"].items():
        if m not in METHODS:
            continue
        pred = predict(m, pr["buckets"], pr["compute_s"], tables["world"], tables["local"], tables["cross"])
        med = v["median_s"]
        err = pred / med - 1
        out.append((f"4 ranks, MPI, 1 Gbit/s: {m} step time, predicted vs measured (s)",
                    f"{pred:.3f} vs {med:.3f} ({100 * err:+.0f}%)", f"within {100 * ERROR_TARGET:.0f}%",
                    abs(err) <= ERROR_TARGET))
    return out


def project():
    lines = gpu_codec_lines()
    n = 10 ** 9
    per = 16 * 2 ** 20  # 64 MiB of float32
    buckets = [per] * (n // per) + ([n % per] if n % per else [])
    out = {}
    for link in LINKS:
        for nodes in NODES:
            w, loc, cr = stated_tables(nodes, link, lines)
            for m in ("none", "int8", "none 2L", "bf16 2L", "int8 2L"):
                out.setdefault(link, {}).setdefault(m, []).append(
                    predict(m, buckets, ASSUMPTIONS["compute_s"], w, loc, cr))
    return out


def plot(proj, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(proj), figsize=(5 * len(proj), 4), sharey=False)
    for ax, (link, rows) in zip(axes, proj.items()):
        for m, ts in rows.items():
            ax.plot(NODES, ts, marker="o", label=m.replace("2L", "two-level") if "2L" in m else f"{m} flat")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes (8 GPUs each)")
        ax.set_ylabel("predicted step time (s)")
        ax.set_title(f"1B params, {link} per node")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    probe_json = os.path.join(RES, "project_scale_probe.json")
    if a.report_only:
        with open(probe_json) as f:
            pr = json.load(f)
    else:
        pr = probe(probe_json)
    lines = ["Cost model of flat and two-level reduction (benchmarks/project_scale.py): checked on the "
             "two-node cluster, then projected with stated link figures.", "",
             "| measurement | value | target | |", "|---|---|---|---|"]
    mark = {True: "met", False: "NOT met", None: ""}
    measured_path = os.path.join(RES, "two_level_mpi_1gbit.json")
    if "skipped" in pr:
        lines.append(f"| model check | skipped: {pr['skipped']} | — | |")
    elif not os.path.exists(measured_path):
        lines.append("| model check | no measured figures: run benchmarks/two_level.py first | — | |")
    else:
        with open(measured_path) as f:
            measured = json.load(f)
        lines += [f"| {m} | {v} | {t} | {mark[k]} |" for m, v, t, k in check_rows(pr, measured)]
    proj = project()
    with open(os.path.join(RES, "project_scale.json"), "w") as f:
        json.dump({"assumptions": ASSUMPTIONS, "nodes": NODES, "predicted_step_s": proj}, f, indent=1)
    plot(proj, os.path.join(RES, "project_scale.png"))
    lines += ["", "Predicted step time (s), 1B parameters, 8 GPUs per node:", "",
              "| link | method | " + " | ".join(f"{n} nodes" for n in NODES) + " |",
              "|---|---|" + "---|" * len(NODES)]
    for link, rows in proj.items():
        for m, ts in rows.items():
            lines.append(f"| {link} | {m} | " + " | ".join(f"{t:.3f}" for t in ts) + " |")
    lines += ["", "Assumptions:"] + [f"- {k}: {v}" for k, v in ASSUMPTIONS.items() if k != "compute_s"]
    with open(os.path.join(RES, "project_scale.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if math.isfinite(sum(sum(v) for r in proj.values() for v in r.values())) else 1


if __name__ == "__main__":
    sys.exit(main())
