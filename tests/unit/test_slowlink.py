"""The benchmarks' throttled link (benchmarks/slowlink.py): its token bucket must not bank idle
time, so that an exchange smaller than the bucket does not cross a slow link at once after a
compute step (the 256 KiB bucket of every rate before 2026-12-06 did: 190 KB in under 1 ms on
the 10 Mbit/s link). Needs root and iproute2; skipped otherwise."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import slowlink  # noqa: E402

why = slowlink.unavailable("10mbit")
needs_link = pytest.mark.skipif(why is not None, reason=f"slow link: {why}")


def test_bucket_depth_is_two_ms_of_the_rate_within_bounds():
    assert slowlink.burst_bytes("10mbit") == 16 * 1024  # 2 ms would be 2.5 KB: the floor
    assert slowlink.burst_bytes("100mbit") == 25_000
    assert slowlink.burst_bytes("1gbit") == 250_000
    assert slowlink.burst_bytes("3gbit") == 256 * 1024  # the ceiling
    with pytest.raises(ValueError, match="tc's notation"):
        slowlink.burst_bytes("10MB/s")


@needs_link
def test_ten_mbit_link_holds_its_rate_after_idle():
    with slowlink.link("10mbit") as (prefix, gbit):  # refuses a banking bucket itself
        ns = prefix[-1]
        took = slowlink.idle_send_s(ns, 190_000, idle=1.0)
    assert 0.0085 < gbit < 0.0105, gbit
    assert took >= 0.9 * (190_000 - slowlink.burst_bytes("10mbit")) * 8 / 10e6, took


@needs_link
def test_a_bucket_that_banks_idle_time_is_refused():
    ns = f"hvdptestbank{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        slowlink.sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        slowlink.sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "10mbit",
                    "burst", "256kb", "latency", "100ms")
        with pytest.raises(SystemExit, match="banks idle time"):
            slowlink.check_no_bank(ns, "10mbit", slowlink.burst_bytes("10mbit"))
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
