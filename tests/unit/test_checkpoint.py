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


def test_a_refused_write_names_the_path_and_the_cause(tmp_path):
    """A writer that reports a full disk as an error of its own (torch.save's RuntimeError,
    raised while handling the OSError): CheckpointWriteError with errno ENOSPC, the path and how
    far the write got; the previous file is left, the temporary removed."""
    import errno
    from hvdp.checkpoint import CheckpointWriteError, atomic_write
    path = str(tmp_path / "c.pt")
    atomic_write(path, lambda f: f.write(b"v1"))

    def full(f):
        f.write(b"x" * 1000)
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")

    with pytest.raises(CheckpointWriteError) as got:
        atomic_write(path, full)
    e = got.value
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC and e.filename == path
    assert f"'{path}'" in str(e) and "No space left on device (ENOSPC)" in str(e), str(e)
    assert "1,000 bytes handed to the file" in str(e), str(e)
    assert open(path, "rb").read() == b"v1" and os.listdir(tmp_path) == ["c.pt"]


def test_rank0_writes_gives_every_rank_the_same_error():
    """Two simulated ranks: rank 0's write fails, the broadcast carries it, both raise the same
    CheckpointWriteError (rank 0's chained to the original); a write that works raises nowhere."""
    import errno
    from hvdp.checkpoint import CheckpointWriteError, rank0_writes
    sent = []

    def bcast(obj, root_rank, name):
        if obj is not None or not sent:
            sent.append(obj)
        return sent[-1]

    def refused():
        raise CheckpointWriteError("could not write the checkpoint '/d/c.pt': Read-only file system (EROFS).",
                                   errno.EROFS, "Read-only file system", "/d/c.pt")
    got = []
    for rank in (0, 1):
        with pytest.raises(CheckpointWriteError) as e:
            rank0_writes(refused, rank, bcast, "/d/c.pt")
        got.append((e.value.errno, e.value.filename, str(e.value), e.value.__cause__ is not None))
    assert got[0][:3] == got[1][:3] and got[0][3] and not got[1][3], got
    assert got[0][2].startswith("hvd.save_checkpoint: rank 0 could not write the checkpoint '/d/c.pt'"), got
    sent.clear()
    done = []
    for rank in (0, 1):
        rank0_writes(lambda: done.append(rank), rank, bcast, "/d/c.pt")
    assert done == [0]
