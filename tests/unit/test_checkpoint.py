"""A process killed while writing a checkpoint leaves the previous one whole."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

WRITER = r"""
import os, sys, time
import numpy as np
from hvdp.checkpoint import atomic_write
path, mode, version = sys.argv[1], sys.argv[2], int(sys.argv[3])
data = np.full(8 * 2**20 // 8, version, dtype=np.float64)  # 8 MiB
def slow_write(f):
    for i, chunk in enumerate(np.array_split(data, 64)):
        f.write(chunk.tobytes()); f.flush(); time.sleep(0.02)
        if i == 32:  # half-way: tell the test, which kills us now
            open(path + ".half", "w").close()
if mode == "atomic":
    atomic_write(path, slow_write)
else:
    with open(path, "wb") as f:
        slow_write(f)
"""


def write(path, mode, version, kill_half_way=False):
    if os.path.exists(path + ".half"):
        os.remove(path + ".half")
    p = subprocess.Popen([sys.executable, "-c", WRITER, path, mode, str(version)])
    if not kill_half_way:
        assert p.wait(timeout=60) == 0
        return
    deadline = time.time() + 30
    while not os.path.exists(path + ".half"):
        assert time.time() < deadline and p.poll() is None, "writer never got half-way"
        time.sleep(0.002)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    os.remove(path + ".half")


def load(path):
    data = np.fromfile(path, dtype=np.float64)
    if data.size != 2**20 or not np.all(data == data[0]):
        raise ValueError("torn checkpoint")
    return int(data[0])


@pytest.mark.timeout(120)
def test_atomic_write_survives_kill(tmp_path):
    path = str(tmp_path / "ckpt.bin")
    write(path, "atomic", 1)
    write(path, "atomic", 2, kill_half_way=True)  # killed half-way through version 2
    assert load(path) == 1
    # a killed writer may leave its temporary file behind; it is never mistaken for the checkpoint
    write(path, "atomic", 3)
    assert load(path) == 3


@pytest.mark.timeout(120)
def test_plain_write_would_tear(tmp_path):
    """The control: the same kill on a plain open/write leaves a torn file."""
    path = str(tmp_path / "ckpt.bin")
    write(path, "naive", 1)
    write(path, "naive", 2, kill_half_way=True)
    with pytest.raises(ValueError, match="torn"):
        load(path)


def test_atomic_save_keeps_the_old_file_when_the_writer_fails(tmp_path):
    from hvdp.checkpoint import atomic_save
    path = str(tmp_path / "model.keras")
    atomic_save(path, lambda tmp: open(tmp, "w").write("v1"))
    assert open(path).read() == "v1"

    def broken(tmp):
        assert tmp.endswith("model.keras")  # writers that check the suffix still see it
        open(tmp, "w").write("v2-partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_save(path, broken)
    assert open(path).read() == "v1" and os.listdir(tmp_path) == ["model.keras"]
