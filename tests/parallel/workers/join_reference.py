"""Shared by the torch and Keras join checks (numpy): the reference for a run with uneven steps.

Training is plain SGD (no momentum), so the final parameters are ``p0 - lr * sum_t applied_t``.
The reference replays the same per-step contributions (every rank's local gradient of every
step it ran) with Horovod's semantics: step t averages the ranks still active at t, dividing
by the full size (a joined rank adds zeros). With error feedback, what the codecs still owe at
the end (the joined ranks' worker residuals / P, every owner's server residual) closes the gap
exactly; without it the gap is the codec's rounding, bounded per step.
"""
import numpy as np

REL = {"fp16": 2 ** -11, "bf16": 2 ** -8}  # one rounding each of inputs and reduced values
ATOL = 2e-5   # float32 updates p -= lr*g over a few steps, divided by lr


def exact_sum(local, steps, size):
    """sum_t mean-with-zeros of the contributions; ``local[r][t][i]``: rank r, step t, tensor i."""
    n_tensors = len(local[0][0])
    out = [np.zeros(np.size(local[0][0][i])) for i in range(n_tensors)]
    for r in range(size):
        for t in range(steps[r]):
            for i in range(n_tensors):
                out[i] += np.asarray(local[r][t][i], np.float64).reshape(-1) / size
    return out


def owed(residuals, buckets, numels, size):
    """Per tensor: what error feedback still holds after the run (``residuals[r]``: rank r's
    ``{"worker": {name: flat}, "server": {name: flat}}``)."""
    out = [np.zeros(n) for n in numels]
    for b, idx in enumerate(buckets):
        name = f"b{b}"
        if name not in residuals[0].get("worker", {}):
            continue
        n = sum(numels[i] for i in idx)
        flat = sum(np.asarray(residuals[r]["worker"][name], np.float64)[:n] for r in range(size)) / size
        flat = flat + np.concatenate([np.asarray(residuals[r]["server"][name], np.float64)
                                      for r in range(size)])[:n]
        off = 0
        for i in idx:
            out[i] = flat[off:off + numels[i]]
            off += numels[i]
    return out


def check_uneven_run(codec, local, steps, size, p0, final, lr, residuals, buckets):
    """Assert the final parameters match the replayed contributions within the codec's bound.
    Returns (largest error, bound used) for the log."""
    numels = [np.size(p) for p in p0]
    exact = exact_sum(local, steps, size)
    applied = [(np.asarray(a, np.float64).reshape(-1) - np.asarray(b, np.float64).reshape(-1)) / lr
               for a, b in zip(p0, final)]
    debt = owed(residuals, buckets, numels, size) if residuals else [np.zeros(n) for n in numels]
    if codec in REL:  # no error feedback: every reduced value rounded, per step
        gmax_steps = [max(float(np.abs(local[r][t][i]).max()) for r in range(size) if t < steps[r]
                          for i in range(len(numels))) for t in range(max(steps))]
        bound = ATOL + sum(3 * REL[codec] * g for g in gmax_steps)
    else:
        bound = ATOL
    err = max(float(np.abs(a + d - e).max()) for a, d, e in zip(applied, debt, exact))
    assert err <= bound, f"{codec}: final parameters off the replayed reference by {err:.3g} > {bound:.3g}"
    # the check can tell: leaving out the last step (where some rank had joined) is caught
    t_last = max(steps) - 1
    last = max(float(np.abs(sum(np.asarray(local[r][t_last][i], np.float64) for r in range(size)
                                if steps[r] > t_last)).max()) / size for i in range(len(numels)))
    assert last > 3 * bound, f"{codec}: bound {bound:.3g} too loose to see a step ({last:.3g})"
    if codec == "int8":  # what is still owed is within the codec's own rounding
        gmax = max(float(np.abs(local[r][t][i]).max()) for r in range(size) for t in range(steps[r])
                   for i in range(len(numels)))
        dmax = max(float(np.abs(d).max()) for d in debt)
        assert dmax <= 4 * gmax / 254, f"int8: owed {dmax:.3g} > {4 * gmax / 254:.3g}"
    if codec in ("int8", "topk"):
        assert max(float(np.abs(d).max()) for d in debt) > 0, f"{codec}: no residual at all?"
    return err, bound
