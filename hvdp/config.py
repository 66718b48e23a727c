"""Environment variables hvdp reads, in one place."""
import os

HVDP_FUSION_THRESHOLD = "HVDP_FUSION_THRESHOLD"          # bytes per compressed bucket
HVDP_MIN_COMPRESS_ELEMENTS = "HVDP_MIN_COMPRESS_ELEMENTS"  # smaller tensors stay uncompressed
HVDP_CACHE_DIR = "HVDP_CACHE_DIR"                        # set-up cache (scripts/setup.sh)
HVDP_COMPILE_CODECS = "HVDP_COMPILE_CODECS"              # 1: torch.compile the codecs (torch)
HVDP_CHECK_AGREEMENT = "HVDP_CHECK_AGREEMENT"            # 0: skip the ranks-agree check (agreement.py)
HVDP_FAILURE_BOARD = "HVDP_FAILURE_BOARD"                # 0: no failure reports between ranks (failures.py)
HVDP_KERNELS = "HVDP_KERNELS"                            # off: no fused codec kernels (hvdp/kernels)


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; unset it or give a number") from None
