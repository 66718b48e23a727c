"""benchmarks/link_timeline.py's arithmetic on a made-up step: the link time of the bytes in each
part of the step, each bucket's start, and the release bound (forward + when a link sending each
bucket at its start, at the full rate, would finish)."""
import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import link_timeline  # noqa: E402


def made_up(steps=8):
    """Forward 10 ms, backward 100 ms, step() 40 ms; buckets of equal size start 50 and 100 ms
    into backward; 40 ms of the link's bytes (1 MB/s: 40 kB) sent from 60 to 100 ms of backward."""
    samples, events, starts, sent = [], [], [], 0
    for k in range(steps):
        t0 = float(k)
        t1, t2, t3 = t0 + 0.010, t0 + 0.110, t0 + 0.150
        events.append((t0, t1, t2, t3))
        starts += [(0, t1 + 0.050), (1, t1 + 0.100)]
        for ms in range(1000):
            t = t0 + ms / 1000
            if t1 + 0.060 < t <= t1 + 0.100:
                sent += 1000
            samples.append((t, sent))
    return {"sizes": [7, 7], "starts": starts, "samples": samples, "events": events}


def test_release_bound_and_the_parts_of_the_step():
    res = link_timeline.summarise(made_up(), gbit=0.008)  # 1 MB/s
    m = res["median_ms"]
    assert res["steps"] == 8 - link_timeline.SKIP
    assert (m["fwd"], m["bwd"], m["tail"], m["step"]) == pytest.approx((10, 100, 40, 150), abs=1e-6)
    assert m["wire"] == pytest.approx(40, abs=1.01) and m["wire_tail"] == pytest.approx(0, abs=1.01)
    assert m["starts"] == pytest.approx([50, 100], abs=1e-6)
    # bucket 0: 50 + 20 = 70 ms; bucket 1 starts at 100: 120; + forward's 10
    assert m["bound"] == pytest.approx(130, abs=1.01)
    bins = res["last_step_bins"].split()  # 2 ms each: forward's 5 (a 6th at the edge), the link busy
    assert 74 <= len(bins) <= 76 and bins[:5] == ["F0"] * 5 and bins.count("B9") >= 19, bins  # 40 ms busy: 20 bins
    assert all(b in ("S0",) for b in bins if b.startswith("S")), bins
