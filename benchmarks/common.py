"""Timing method shared by the benchmarks: Horovod's synthetic-benchmark recipe.

Warm-up batches, then ``iters`` iterations of ``batches`` batches; each iteration gives one rate;
report the mean and the 95% confidence interval of the mean (Student t).
"""
import statistics
import time

# two-sided 95% Student t quantiles by degrees of freedom
_T95 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 14: 2.145, 19: 2.093, 29: 2.045}


def t95(df):
    return _T95.get(df) or _T95[max(k for k in _T95 if k <= df)] if df >= 1 else float("nan")


def mean_ci(values):
    m = statistics.mean(values)
    if len(values) < 2:
        return m, float("nan")
    return m, t95(len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5


def ratio_ci(a, b):
    """Mean and 95% interval of a[i] / b[i] for paired (interleaved) measurements."""
    return mean_ci([x / y for x, y in zip(a, b)])


def time_batches(step, batches):
    t0 = time.perf_counter()
    for _ in range(batches):
        step()
    return (time.perf_counter() - t0) / batches
