# shellcheck shell=bash
# Find the CUDA toolkit and NCCL that scripts/build_horovod.sh needs for HVDP_GPU=1, and export
# them the way Horovod's CMake looks for them. Sourced, not run:
#
#   source scripts/gpu_env.sh PYTHON      # PYTHON: the interpreter the wheel is built for
#   HVDP_GPU=1 scripts/build_horovod.sh PYTHON OUT_DIR
#
# Used by `make nccl-build` (no GPU needed: compile and link only) and by the Dockerfile, so the
# GPU build has one recipe. Each setting can be given instead of discovered:
#   HOROVOD_CUDA_HOME / CUDA_HOME   toolkit root holding bin/nvcc (default /usr/local/cuda, else
#                                   the newest /usr/local/cuda-*)
#   HOROVOD_NCCL_HOME               NCCL root with include/nccl.h and lib/libnccl.so* (default:
#                                   the nvidia-nccl wheel installed next to PYTHON's torch, else
#                                   the system's /usr/include + /usr/lib/x86_64-linux-gnu)
#   HOROVOD_BUILD_CUDA_CC_LIST      compute capabilities for Horovod's few CUDA kernels
#                                   (default below: Turing .. Blackwell)
_hvdp_gpu_env() {
    local py=${1:?usage: source scripts/gpu_env.sh PYTHON}
    local err="hvdp gpu_env:"
    command -v "$py" >/dev/null || { echo "$err '$py' is not an interpreter" >&2; return 1; }

    # --- CUDA toolkit -----------------------------------------------------------------------
    local home=${HOROVOD_CUDA_HOME:-${CUDA_HOME:-}}
    if [[ -z "$home" ]]; then
        local c
        for c in /usr/local/cuda $(ls -d /usr/local/cuda-* 2>/dev/null | sort -V -r); do
            [[ -x "$c/bin/nvcc" ]] && { home=$c; break; }
        done
    fi
    if [[ -z "$home" || ! -x "$home/bin/nvcc" ]]; then
        echo "$err no nvcc found (looked in \$HOROVOD_CUDA_HOME, \$CUDA_HOME, /usr/local/cuda*);" \
             "install the CUDA toolkit or set HOROVOD_CUDA_HOME to its root" >&2
        return 1
    fi
    [[ -f "$home/include/cuda_runtime.h" ]] \
        || { echo "$err $home/include/cuda_runtime.h missing: $home is not a full toolkit" >&2; return 1; }
    local nvcc_ver
    nvcc_ver=$("$home/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
    # torch's CUDA build and nvcc must agree on the major version, or the extension links
    # against one runtime while torch loads another.
    local torch_cuda
    torch_cuda=$("$py" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null) \
        || { echo "$err torch is not importable by $py" >&2; return 1; }
    [[ -n "$torch_cuda" ]] \
        || { echo "$err $py has a CPU-only torch; install a CUDA build (e.g. torch from PyPI)" >&2; return 1; }
    if [[ "${torch_cuda%%.*}" != "${nvcc_ver%%.*}" ]]; then
        echo "$err torch is built for CUDA $torch_cuda but $home/bin/nvcc is $nvcc_ver;" \
             "point HOROVOD_CUDA_HOME at a CUDA ${torch_cuda%%.*} toolkit" >&2
        return 1
    fi

    # --- NCCL -------------------------------------------------------------------------------
    local inc lib
    if [[ -n "${HOROVOD_NCCL_HOME:-}" ]]; then
        inc=$HOROVOD_NCCL_HOME/include lib=$HOROVOD_NCCL_HOME/lib
    else
        # The nvidia-nccl-cuXX wheel that comes with torch; its module path differs by wheel
        # generation (nvidia/nccl, nvidia/cu13/...), so look for the header itself.
        local wheel_inc
        wheel_inc=$("$py" - <<'PYEOF'
import glob, os
try:
    import nvidia
except ImportError:
    raise SystemExit(0)
for root in nvidia.__path__:
    for h in sorted(glob.glob(os.path.join(root, "**", "include", "nccl.h"), recursive=True)):
        print(os.path.dirname(h)); raise SystemExit(0)
PYEOF
)
        if [[ -n "$wheel_inc" ]]; then
            inc=$wheel_inc lib=$(dirname "$wheel_inc")/lib
        else
            inc=/usr/include lib=/usr/lib/x86_64-linux-gnu
        fi
    fi
    [[ -f "$inc/nccl.h" ]] || { echo "$err no nccl.h in $inc; install libnccl-dev or nvidia-nccl-cu${torch_cuda%%.*}, or set HOROVOD_NCCL_HOME" >&2; return 1; }
    local so
    so=$(ls "$lib"/libnccl.so* 2>/dev/null | head -1)
    [[ -n "$so" ]] || { echo "$err no libnccl.so* in $lib; set HOROVOD_NCCL_HOME" >&2; return 1; }
    if [[ ! -e "$lib/libnccl.so" ]]; then
        # Wheels ship only libnccl.so.2; CMake's find_library wants the unversioned name. A
        # link in a directory of our own, rather than writing into the installed package.
        local shim
        shim=$("$py" -c 'import sys; print(sys.prefix)')/hvdp-nccl-lib
        mkdir -p "$shim" && ln -sf "$so" "$shim/libnccl.so"
        lib=$shim
    fi
    # Shared, not static: the wheel has no libnccl_static.a, and torch loads the same library.
    export HOROVOD_NCCL_INCLUDE=$inc HOROVOD_NCCL_LIB=$lib HOROVOD_NCCL_LINK=SHARED
    export HOROVOD_CUDA_HOME=$home CUDA_HOME=$home PATH=$home/bin:$PATH

    # --- target GPUs --------------------------------------------------------------------------
    # Horovod compiles its kernels for every arch nvcc knows unless told; a list keeps the
    # build short. Each entry must be one nvcc accepts (CUDA 13 dropped sm_50..sm_72).
    export HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-75,80,86,89,90,100,120}
    local known cc
    known=" $("$home/bin/nvcc" --list-gpu-arch 2>/dev/null | sed 's/compute_//' | tr '\n' ' ') "
    for cc in ${HOROVOD_BUILD_CUDA_CC_LIST//,/ }; do
        [[ "$known" == *" $cc "* ]] || { echo "$err nvcc $nvcc_ver cannot build compute_$cc;" \
            "set HOROVOD_BUILD_CUDA_CC_LIST to a subset of:$known" >&2; return 1; }
    done
    echo "gpu_env: CUDA $nvcc_ver at $home (torch CUDA $torch_cuda); NCCL $inc, $lib;" \
         "archs $HOROVOD_BUILD_CUDA_CC_LIST"
}
_hvdp_gpu_env "$@"
