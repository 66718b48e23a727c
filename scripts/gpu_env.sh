# shellcheck shell=bash
# Find the CUDA toolkit and NCCL that scripts/build_horovod.sh needs for HVDP_GPU=1, and export
# them the way Horovod's CMake looks for them. Sourced, or run with the command to run in it:
#
#   export HVDP_FRAMEWORKS=torch            # the frameworks the wheel is built for
#   source scripts/gpu_env.sh PYTHON        # PYTHON: the interpreter the wheel is built for
#   HVDP_GPU=1 scripts/build_horovod.sh PYTHON OUT_DIR
#
#   HVDP_FRAMEWORKS=torch HVDP_GPU=1 bash scripts/gpu_env.sh PYTHON scripts/build_horovod.sh PYTHON OUT_DIR
#
# Used by `make nccl-build` (no GPU needed: compile and link only) and by the Dockerfile, so the
# GPU build has one recipe. Each setting can be given instead of discovered:
#   HVDP_FRAMEWORKS                 "torch tensorflow" (default) or a subset: whose CUDA to match
#   HOROVOD_CUDA_HOME / CUDA_HOME   toolkit root holding bin/nvcc (default: the first of
#                                   /usr/local/cuda, /usr/local/cuda-* (newest first) whose nvcc
#                                   has the frameworks' CUDA major version)
#   HOROVOD_NCCL_HOME               NCCL root with include/nccl.h and lib/libnccl.so* (default:
#                                   the nvidia-nccl wheel installed in PYTHON's environment, the
#                                   one the framework itself loads; else the system's)
#   HOROVOD_BUILD_CUDA_CC_LIST      compute capabilities for Horovod's few CUDA kernels
#                                   (default below: Turing .. Blackwell)

_hvdp_framework_cuda() {  # PYTHON FRAMEWORK -> the CUDA version it was built with ("" = CPU)
    case $2 in
        torch) "$1" -c 'import torch; print(torch.version.cuda or "")' ;;
        tensorflow) "$1" -c 'import tensorflow as tf; print(tf.sysconfig.get_build_info().get("cuda_version", ""))' ;;
    esac
}

_hvdp_gpu_env() {
    local py=${1:?usage: source scripts/gpu_env.sh PYTHON}
    local err="hvdp gpu_env:"
    command -v "$py" >/dev/null || { echo "$err '$py' is not an interpreter" >&2; return 1; }

    # --- the frameworks' CUDA -------------------------------------------------------------
    # Horovod's extension runs inside the framework's process and shares its CUDA streams, so
    # the toolkit it is compiled with must have the framework's CUDA major version.
    local fw fw_cuda want=""
    for fw in ${HVDP_FRAMEWORKS:-torch tensorflow}; do
        [[ "$fw" == torch || "$fw" == tensorflow ]] \
            || { echo "$err unknown framework '$fw' in HVDP_FRAMEWORKS (torch, tensorflow)" >&2; return 1; }
        fw_cuda=$(_hvdp_framework_cuda "$py" "$fw" 2>/dev/null) \
            || { echo "$err $fw is not importable by $py (HVDP_FRAMEWORKS=${HVDP_FRAMEWORKS:-torch tensorflow})" >&2; return 1; }
        [[ -n "$fw_cuda" ]] || { echo "$err $py has a CPU-only $fw; install its CUDA build" >&2; return 1; }
        if [[ -n "$want" && "${fw_cuda%%.*}" != "${want%%.*}" ]]; then
            echo "$err the frameworks need different CUDA majors ($want, $fw $fw_cuda):" \
                 "build each in its own environment (HVDP_FRAMEWORKS=$fw)" >&2
            return 1
        fi
        want=$fw_cuda
    done

    # --- CUDA toolkit -----------------------------------------------------------------------
    local home=${HOROVOD_CUDA_HOME:-${CUDA_HOME:-}} c ver found=""
    if [[ -z "$home" ]]; then
        while read -r c; do
            [[ -x "$c/bin/nvcc" ]] || continue
            ver=$("$c/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
            found+=" $c ($ver)"
            [[ "${ver%%.*}" == "${want%%.*}" ]] && { home=$c; break; }
        done < <(echo /usr/local/cuda; printf '%s\n' /usr/local/cuda-* | sort -V -r)
        if [[ -z "$home" ]]; then
            echo "$err no CUDA ${want%%.*} toolkit for CUDA $want frameworks (found:${found:- none});" \
                 "install one or set HOROVOD_CUDA_HOME to its root" >&2
            return 1
        fi
    fi
    [[ -x "$home/bin/nvcc" ]] \
        || { echo "$err $home/bin/nvcc missing: point HOROVOD_CUDA_HOME (or CUDA_HOME) at a toolkit root" >&2; return 1; }
    [[ -f "$home/include/cuda_runtime.h" ]] \
        || { echo "$err $home/include/cuda_runtime.h missing: $home is not a full toolkit" >&2; return 1; }
    local nvcc_ver
    nvcc_ver=$("$home/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
    if [[ "${want%%.*}" != "${nvcc_ver%%.*}" ]]; then
        echo "$err the frameworks are built for CUDA $want but $home/bin/nvcc is $nvcc_ver;" \
             "point HOROVOD_CUDA_HOME at a CUDA ${want%%.*} toolkit" >&2
        return 1
    fi

    # --- NCCL -------------------------------------------------------------------------------
    local inc lib
    if [[ -n "${HOROVOD_NCCL_HOME:-}" ]]; then
        inc=$HOROVOD_NCCL_HOME/include lib=$HOROVOD_NCCL_HOME/lib
    else
        # The nvidia-nccl-cuXX wheel that comes with the framework; its module path differs by
        # wheel generation (nvidia/nccl, nvidia/cu13/...), so look for the header itself.
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
    [[ -f "$inc/nccl.h" ]] || { echo "$err no nccl.h in $inc; install nvidia-nccl-cu${want%%.*} (or libnccl-dev)," \
                                     "or set HOROVOD_NCCL_HOME" >&2; return 1; }
    local so
    so=$(compgen -G "$lib/libnccl.so*" | head -1 || true)
    [[ -n "$so" ]] || { echo "$err no libnccl.so* in $lib; set HOROVOD_NCCL_HOME" >&2; return 1; }
    if [[ ! -e "$lib/libnccl.so" ]]; then
        # Wheels ship only libnccl.so.2; CMake's find_library wants the unversioned name. A
        # link in a directory of our own, rather than writing into the installed package.
        local shim
        shim=$("$py" -c 'import sys; print(sys.prefix)')/hvdp-nccl-lib
        mkdir -p "$shim" && ln -sf "$so" "$shim/libnccl.so"
        lib=$shim
    fi
    # Shared, not static: the wheel has no libnccl_static.a, and the framework loads the same
    # library, so one NCCL serves both.
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
    echo "gpu_env: CUDA $nvcc_ver at $home (frameworks: CUDA $want); NCCL $inc, $lib;" \
         "archs $HOROVOD_BUILD_CUDA_CC_LIST"
}
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then  # run rather than sourced: the environment for one command
    [[ $# -ge 2 ]] || { echo "usage: gpu_env.sh PYTHON CMD [ARG...]  (or: source gpu_env.sh PYTHON)" >&2; exit 2; }
    _hvdp_gpu_env "$1" || exit 1
    shift
    exec "$@"
fi
_hvdp_gpu_env "$@"
