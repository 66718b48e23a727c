"""Boards: where the ranks of a job leave short notes for each other (failure reports, "done"
marks, the stall watchdog's notes), keyed by name, outside Horovod's collectives.

- :class:`KVBoard`: the key-value store horovodrun already serves to every worker for its Gloo
  rendezvous (any host).
- :class:`DirBoard`: a private directory in tmp (0700, owner and mode checked before each write
  and read), named after the user and the MPI job; only ranks on one host share it.

:func:`board_from_env` picks the job's board, or None (turned off by ``HVDP_FAILURE_BOARD=0``, no
job identity, or a directory another account made first).

Example::

    board = board_from_env()
    if board is not None:
        board.put("stall-1", b"{...}"); board.get("stall-1")
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.error
import urllib.request
import warnings
from typing import List, Mapping, Optional

from ..config import failure_board
from ..private import Refused, private_dir, refusal

KV_SCOPE = "hvdp_failures"


class KVBoard:
    """horovodrun's rendezvous HTTP store (Gloo): one key holds the latest report."""

    def __init__(self, addr: str, port: int, timeout: float = 2.0):
        self.base = f"http://{addr}:{port}/{KV_SCOPE}"
        self.url = f"{self.base}/latest"
        self.timeout = timeout

    def _put(self, url: str, data: bytes) -> None:
        req = urllib.request.Request(url, data=data, method="PUT")
        urllib.request.urlopen(req, timeout=self.timeout).close()

    def _get(self, url: str) -> Optional[bytes]:
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as r:
                return r.read()
        except urllib.error.HTTPError as e:  # 404: not there
            if e.code == 404:
                return None
            raise

    def post(self, rank: int, data: bytes) -> None:
        self._put(self.url, data)

    def read(self) -> List[bytes]:
        got = self._get(self.url)
        return [] if got is None else [got]

    def put(self, key: str, data: bytes) -> None:
        self._put(f"{self.base}/{key}", data)

    def get(self, key: str) -> Optional[bytes]:
        return self._get(f"{self.base}/{key}")

    def mark_done(self, rank: int, data: bytes) -> None:
        self.put(f"done-{rank}", data)

    def read_done(self, rank: int) -> Optional[bytes]:
        return self.get(f"done-{rank}")


class DirBoard:
    """A directory: one file per reporting rank (ranks on one host, any controller).

    The directory is private (``hvdp.private``: made 0700, owner and mode checked before every
    write and read): a directory another account made first is refused (``Refused``), so its
    reports can be neither read nor forged by another user."""

    def __init__(self, path: str):
        self.path = path

    def _dir(self) -> str:
        return private_dir(os.path.dirname(self.path), os.path.basename(self.path))

    def _readable(self) -> bool:
        """Whether the directory exists and is private (missing: False; planted: Refused)."""
        if not os.path.lexists(self.path):
            return False
        why = refusal(self.path, "dir")
        if why is not None:
            raise Refused(self.path, why)
        return True

    def _write(self, name: str, data: bytes) -> None:
        d = self._dir()
        tmp = os.path.join(d, f".{name}.{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(d, name))

    def put(self, key: str, data: bytes) -> None:
        self._write(f"{key}.json", data)

    def get(self, key: str) -> Optional[bytes]:
        if not self._readable():
            return None
        try:
            with open(os.path.join(self.path, f"{key}.json"), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def post(self, rank: int, data: bytes) -> None:
        self.put(f"rank-{rank}", data)

    def mark_done(self, rank: int, data: bytes) -> None:
        self.put(f"done-{rank}", data)

    def read_done(self, rank: int) -> Optional[bytes]:
        return self.get(f"done-{rank}")

    def read(self) -> List[bytes]:
        if not self._readable():
            return []
        names = sorted(n for n in os.listdir(self.path) if n.startswith("rank-"))
        out = []
        for n in names:
            with open(os.path.join(self.path, n), "rb") as f:
                out.append(f.read())
        return out


# Open MPI names each job in the environment it gives its processes; one of these is enough.
_MPI_JOB_VARS = ("PMIX_NAMESPACE", "OMPI_MCA_orte_hnp_uri", "OMPI_MCA_ess_base_jobid", "PMI_JOBID")


def board_from_env(environ: Optional[Mapping[str, str]] = None):
    """The board this job's ranks share, or None (turned off, or no job identity found)."""
    env = os.environ if environ is None else environ
    if not failure_board(env):  # HVDP_FAILURE_BOARD; not a boolean: ValueError
        return None
    addr, port = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), env.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    if addr and port:
        return KVBoard(addr, int(port))
    job = next((env[v] for v in _MPI_JOB_VARS if env.get(v)), None)
    if job is None:
        return None
    key = hashlib.sha1(job.encode()).hexdigest()[:16]
    board = DirBoard(os.path.join(tempfile.gettempdir(), f"hvdp-failures-{os.geteuid()}-{key}"))
    try:
        board._readable()
    except Refused as e:
        warnings.warn(f"hvdp: no failure reports between ranks: {e}; another account could have "
                      "made it to read or forge them. Remove it (or set TMPDIR to a private "
                      "directory); HVDP_FAILURE_BOARD=0 silences this", stacklevel=2)
        return None
    return board
