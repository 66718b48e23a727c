"""Environment variables hvdp reads, in one place."""
import os

HVDP_FUSION_THRESHOLD = "HVDP_FUSION_THRESHOLD"          # bytes per compressed bucket
HVDP_MIN_COMPRESS_ELEMENTS = "HVDP_MIN_COMPRESS_ELEMENTS"  # smaller tensors stay uncompressed
HVDP_CACHE_DIR = "HVDP_CACHE_DIR"                        # set-up cache (scripts/setup.sh)
HVDP_COMPILE_CODECS = "HVDP_COMPILE_CODECS"              # 1: torch.compile the codecs (torch)
HVDP_CHECK_AGREEMENT = "HVDP_CHECK_AGREEMENT"            # 0: skip the ranks-agree check (agreement.py)
HVDP_FAILURE_BOARD = "HVDP_FAILURE_BOARD"                # 0: no failure reports between ranks (failures.py)
HVDP_KERNELS = "HVDP_KERNELS"                            # off: no fused codec kernels (hvdp/kernels)
HOROVOD_ELASTIC = "HOROVOD_ELASTIC"                      # 1: an elastic job (horovodrun sets it)


def elastic_mode(environ=None) -> bool:
    """Whether this process runs in a Horovod elastic job: ``HOROVOD_ELASTIC=1``, which horovodrun
    sets in the workers of an elastic run (--host-discovery-script, --min-np). ``environ``: a
    mapping to read instead of ``os.environ``."""
    return (environ if environ is not None else os.environ).get(HOROVOD_ELASTIC) == "1"


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; unset it or give a number") from None
