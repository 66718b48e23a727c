"""A step's time against its limit, and where it goes (issue 36, item 1): one table for
``tta.py`` and ``overlap.py``.

- **limit** = max(compute only's step, the method's measured bytes per step per worker × the
  workers sharing the link ÷ the measured link rate): the step if the exchange hid wholly under
  compute, or compute under the exchange.
- **phases** (hvdp's methods): mean ms per step of rank 0 from ``compression_stats()["phase_ms"]``:
  encode, wire wait (waiting for a collective, in a gradient hook or at ``step()``), owner (the
  reduced chunk's decode-sum and re-encode), final decode; DDP's hooks report none.
- **rest** = step − compute only − the phases: time on the wire that no phase waited for
  (Horovod's queue, the plain tensors' allreduce), Python, and noise.
"""
PHASES = ("encode", "wire_wait", "owner", "final_decode")
HEADER = ("| method | link | step ms | limit ms | step / limit | compute ms | encode | wire wait | owner "
          "| final decode | rest |\n|---|---|---|---|---|---|---|---|---|---|---|")


def limit_s(compute_s: float, bytes_per_worker: float, gbit_s: float, workers: int = 2) -> float:
    """max(compute, every worker's bytes through the one shaped link at the measured rate)."""
    wire = bytes_per_worker * workers * 8 / (gbit_s * 1e9) if gbit_s else 0.0
    return max(compute_s, wire)


def row(method: str, link: str, step_s: float, compute_s: float, bytes_per_worker: float, gbit_s: float,
        phase_ms=None, workers: int = 2) -> str:
    """One line of the table (``phase_ms``: hvdp's phases, or None: a method without them)."""
    lim = limit_s(compute_s, bytes_per_worker, gbit_s, workers)
    phases = [float((phase_ms or {}).get(k, 0.0)) for k in PHASES]
    shown = " | ".join(f"{v:.1f}" for v in phases) if phase_ms is not None else "— | — | — | —"
    rest = step_s * 1000 - compute_s * 1000 - sum(phases)
    return (f"| {method} | {link} | {step_s * 1000:.0f} | {lim * 1000:.0f} | {step_s / lim:.2f} | "
            f"{compute_s * 1000:.0f} | {shown} | {rest:.0f} |")
