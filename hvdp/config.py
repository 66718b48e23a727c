"""Environment variables hvdp reads, in one place, under one rule.

- Booleans accept ``1/0``, ``true/false``, ``yes/no``, ``on/off`` in any case; empty or unset
  means the variable's default.
- Integers must be whole numbers within the variable's range; empty or unset means the default.
- Choices (``HVDP_KERNELS``) must be one of the listed words, in any case.

Any other value raises ``ValueError`` naming the variable, the value and what it accepts, at the
first read: a typo never turns a setting silently on or off. Each variable has one reader here;
``problems`` checks them all at once (``python -m hvdp doctor``).

Example::

    config.check_agreement()                             # HVDP_CHECK_AGREEMENT, default on
    config.env_bool("HVDP_X", False, {"HVDP_X": "Yes"})  # True; "maybe" raises ValueError
"""
import os
from typing import List, Mapping, Optional, Sequence, Tuple

HVDP_FUSION_THRESHOLD = "HVDP_FUSION_THRESHOLD"          # bytes per compressed bucket
HVDP_MIN_COMPRESS_ELEMENTS = "HVDP_MIN_COMPRESS_ELEMENTS"  # smaller tensors stay uncompressed
HVDP_CACHE_DIR = "HVDP_CACHE_DIR"                        # every cache: set-up envs, wheels, kernels
HVDP_COMPILE_CODECS = "HVDP_COMPILE_CODECS"              # 1: torch.compile the codecs (torch)
HVDP_CHECK_AGREEMENT = "HVDP_CHECK_AGREEMENT"            # 0: skip the ranks-agree check (agreement.py)
HVDP_FAILURE_BOARD = "HVDP_FAILURE_BOARD"                # 0: no failure reports between ranks (failures.py)
HVDP_KERNELS = "HVDP_KERNELS"                            # off: no fused codec kernels (hvdp/kernels)
HVDP_STALL_TIMEOUT_SECONDS = "HVDP_STALL_TIMEOUT_SECONDS"  # 0: no stall watchdog (watchdog.py)
HVDP_FLIGHT_RECORDS = "HVDP_FLIGHT_RECORDS"              # collectives in the flight record; 0: off (flight.py)
HVDP_FLIGHT_DIR = "HVDP_FLIGHT_DIR"                      # where flight records are dumped (flight.py)
HVDP_EXIT_WAIT_SECONDS = "HVDP_EXIT_WAIT_SECONDS"      # 0: a rank's exit waits for no other (exits.py)
HVDP_OVERLAP = "HVDP_OVERLAP"                            # 0: a bucket's next phase waits for step() (drive.py)
HVDP_SLEEPING_WAIT = "HVDP_SLEEPING_WAIT"                # 0: Horovod's spinning wait (hvdp.torch waits)
HVDP_DDP_ADDR = "HVDP_DDP_ADDR"                          # examples/benchmarks: DDP's Gloo rendezvous address
HVDP_DDP_PORT = "HVDP_DDP_PORT"                          # examples/benchmarks: DDP's Gloo rendezvous port
HOROVOD_ELASTIC = "HOROVOD_ELASTIC"                      # 1: an elastic job (horovodrun sets it)

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
KERNEL_MODES = ("auto", "off")
Environ = Optional[Mapping[str, str]]


def _raw(name: str, environ: Environ) -> Optional[str]:
    value = (os.environ if environ is None else environ).get(name)
    return None if value is None or value.strip() == "" else value


def env_bool(name: str, default: bool, environ: Environ = None) -> bool:
    """``name`` as a boolean (see the module's rule); ``environ``: a mapping to read instead of
    ``os.environ``."""
    raw = _raw(name, environ)
    if raw is None:
        return default
    word = raw.strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean: give one of {', '.join(TRUE)} (on) or "
                     f"{', '.join(FALSE)} (off), in any case, or unset it for the default "
                     f"({'on' if default else 'off'})")


def _range(minimum: Optional[int], maximum: Optional[int]) -> str:
    if minimum is not None and maximum is not None:
        return f"from {minimum} to {maximum}"
    if minimum is not None:
        return f">= {minimum}"
    return f"<= {maximum}" if maximum is not None else "(any)"


def env_int(name: str, default: int, minimum: Optional[int] = None, maximum: Optional[int] = None,
            environ: Environ = None) -> int:
    """``name`` as a whole number within ``[minimum, maximum]`` (None: unbounded), else ``default``
    when empty or unset."""
    raw = _raw(name, environ)
    if raw is None:
        return default
    valid = f"give a whole number {_range(minimum, maximum)}, or unset it for the default ({default})"
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer: {valid}") from None
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name}={raw!r} is out of range: {valid}")
    return value


def env_choice(name: str, choices: Sequence[str], default: str, environ: Environ = None) -> str:
    """``name`` as one of ``choices`` (compared in lower case), else ``default`` when empty or unset."""
    raw = _raw(name, environ)
    if raw is None:
        return default
    word = raw.strip().lower()
    if word not in choices:
        raise ValueError(f"{name}={raw.strip()!r} is not one of {', '.join(choices)}; "
                         "unset it or give one of those")
    return word


# --- the variables, one reader each -------------------------------------------------------------
def compile_codecs_default(environ: Environ = None) -> bool:
    """``HVDP_COMPILE_CODECS`` (default off): torch.compile the codecs when the optimizer's
    ``compile_codecs`` argument is not given."""
    return env_bool(HVDP_COMPILE_CODECS, False, environ)


def check_agreement(environ: Environ = None) -> bool:
    """``HVDP_CHECK_AGREEMENT`` (default on): the ranks-agree check (it must be the same on every rank)."""
    return env_bool(HVDP_CHECK_AGREEMENT, True, environ)


def failure_board(environ: Environ = None) -> bool:
    """``HVDP_FAILURE_BOARD`` (default on): failure reports between ranks."""
    return env_bool(HVDP_FAILURE_BOARD, True, environ)


def stall_timeout_s(environ: Environ = None) -> int:
    """``HVDP_STALL_TIMEOUT_SECONDS`` (default 600): how long a collective (hvdp's, or Horovod's
    called through hvdp.torch / hvdp.keras) may wait for the other ranks before the watchdog ends
    the job; 0: no watchdog."""
    return env_int(HVDP_STALL_TIMEOUT_SECONDS, 600, minimum=0, environ=environ)


def exit_wait_s(environ: Environ = None) -> int:
    """``HVDP_EXIT_WAIT_SECONDS`` (default 30): how long a rank of a job with process sets smaller
    than the job waits, when it ends, for the other ranks to end (``hvdp.cluster.exits``); 0: not at all."""
    return env_int(HVDP_EXIT_WAIT_SECONDS, 30, minimum=0, environ=environ)


def flight_records(environ: Environ = None) -> int:
    """``HVDP_FLIGHT_RECORDS`` (default 1024): how many of its last collectives each process keeps
    in its flight record; 0: no record."""
    return env_int(HVDP_FLIGHT_RECORDS, 1024, minimum=0, maximum=1 << 20, environ=environ)


def flight_dir(environ: Environ = None) -> str:
    """``HVDP_FLIGHT_DIR``: where each rank dumps its flight record (default ``hvdp-flight`` in
    the working directory)."""
    raw = _raw(HVDP_FLIGHT_DIR, environ)
    return "hvdp-flight" if raw is None else os.path.expanduser(raw.strip())


def overlap(environ: Environ = None) -> bool:
    """``HVDP_OVERLAP`` (default on): hvdp.torch starts a bucket's next phase from its gradient
    hooks as soon as the previous one is done; off: at ``step()`` (the same results either way)."""
    return env_bool(HVDP_OVERLAP, True, environ)


def sleeping_wait(environ: Environ = None) -> bool:
    """``HVDP_SLEEPING_WAIT`` (default on): hvdp.torch waits for Horovod's collectives by sleeping
    between polls; off: by Horovod's own spinning wait (a core per waiting rank, the lowest latency)."""
    return env_bool(HVDP_SLEEPING_WAIT, True, environ)


def kernels_mode(environ: Environ = None) -> str:
    """``HVDP_KERNELS``: ``auto`` (default: kernels where one serves) or ``off`` (array ops)."""
    return env_choice(HVDP_KERNELS, KERNEL_MODES, "auto", environ)


def fusion_threshold_bytes(default: int, environ: Environ = None) -> int:
    """``HVDP_FUSION_THRESHOLD``: float32 bytes per compressed bucket, >= 1."""
    return env_int(HVDP_FUSION_THRESHOLD, default, minimum=1, environ=environ)


def min_compress_elements(default: int, environ: Environ = None) -> int:
    """``HVDP_MIN_COMPRESS_ELEMENTS``: tensors with fewer elements stay uncompressed, >= 0."""
    return env_int(HVDP_MIN_COMPRESS_ELEMENTS, default, minimum=0, environ=environ)


def cache_dir(environ: Environ = None) -> Optional[str]:
    """``HVDP_CACHE_DIR``: every cache of hvdp's (set-up environments, wheels, compiled kernels), or
    None: the default place."""
    raw = _raw(HVDP_CACHE_DIR, environ)
    return None if raw is None else os.path.expanduser(raw.strip())


def ddp_addr(environ: Environ = None) -> str:
    """``HVDP_DDP_ADDR`` (examples, benchmarks): DDP's Gloo rendezvous address, default 127.0.0.1."""
    raw = _raw(HVDP_DDP_ADDR, environ)
    return "127.0.0.1" if raw is None else raw.strip()


def ddp_port(default: int, environ: Environ = None) -> int:
    """``HVDP_DDP_PORT`` (examples, benchmarks): DDP's Gloo rendezvous port, 1 to 65535."""
    return env_int(HVDP_DDP_PORT, default, minimum=1, maximum=65535, environ=environ)


def elastic_mode(environ: Environ = None) -> bool:
    """Whether this process runs in a Horovod elastic job: ``HOROVOD_ELASTIC=1``, which horovodrun
    sets in the workers of an elastic run (--host-discovery-script, --min-np). ``environ``: a
    mapping to read instead of ``os.environ``."""
    return (environ if environ is not None else os.environ).get(HOROVOD_ELASTIC) == "1"


_CHECKS = (compile_codecs_default, check_agreement, failure_board, kernels_mode, overlap, sleeping_wait,
           lambda env: fusion_threshold_bytes(1, env), lambda env: min_compress_elements(0, env),
           lambda env: ddp_port(1, env), stall_timeout_s, flight_records, exit_wait_s)


def problems(environ: Environ = None) -> List[Tuple[str, str]]:
    """(problem, fix) for each hvdp variable set to a value its reader refuses; [] when all are good."""
    out = []
    for check in _CHECKS:
        try:
            check(environ)
        except ValueError as e:
            out.append((str(e), f"fix or unset {str(e).split('=', 1)[0]}"))
    return out
