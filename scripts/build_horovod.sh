#!/usr/bin/env bash
# Build a Horovod wheel from PyPI's sdist for today's PyTorch and TensorFlow.
#
# Usage: scripts/build_horovod.sh PYTHON OUT_DIR
#   PYTHON   interpreter whose environment already holds torch / tensorflow (built against)
#   OUT_DIR  where the wheel is written
# Environment:
#   HOROVOD_VERSION          default 0.28.1
#   HVDP_GPU=1               build NCCL GPU operations (HOROVOD_GPU_OPERATIONS=NCCL); the
#                            CUDA toolkit and NCCL must be findable (CUDA_HOME, HOROVOD_NCCL_HOME)
#   HVDP_FRAMEWORKS          "torch tensorflow" (default) or a subset
#
# Why patching is needed (Horovod 0.28.1, the last release, 2023):
#   1. The top-level and horovod/torch CMakeLists pin C++14; torch >= 2.1 headers need C++17,
#      so the torch extension fails to compile. Raising the standard to 17 is safe: the sources
#      are valid C++17 and TensorFlow's extension is already built as C++17 by Horovod itself.
#   2. horovod/tensorflow/xla_mpi_ops.cc (XLA custom-call ops, used only when a TF function is
#      compiled with XLA on GPU) includes headers that TF 2.21 no longer ships at those paths.
#      Leaving that one source out drops only the XLA ops; every regular TF op is still built.
# This is the whole fix; nothing else in Horovod is changed, and it is applied to a private copy.
set -euo pipefail
PY=${1:?usage: build_horovod.sh PYTHON OUT_DIR}
OUT=${2:?usage: build_horovod.sh PYTHON OUT_DIR}
VER=${HOROVOD_VERSION:-0.28.1}
FRAMEWORKS=${HVDP_FRAMEWORKS:-torch tensorflow}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download --quiet --no-deps --no-binary :all: "horovod==$VER" -d "$work"
tar -xzf "$work/horovod-$VER.tar.gz" -C "$work"
src="$work/horovod-$VER"

patch_file() {  # file, python regex, replacement: fail loudly if the sdist changed under us
    "$PY" - "$@" <<'PYEOF'
import re, sys
path, pattern, repl = sys.argv[1:4]
text = open(path).read()
new, n = re.subn(pattern, repl, text, flags=re.M)
if n == 0:
    sys.exit(f"build_horovod: pattern {pattern!r} not found in {path}; the patch needs updating")
open(path, "w").write(new)
PYEOF
}
patch_file "$src/CMakeLists.txt" '^set\(CMAKE_CXX_STANDARD 14\)' 'set(CMAKE_CXX_STANDARD 17)'
patch_file "$src/horovod/torch/CMakeLists.txt" 'set\(CMAKE_CXX_STANDARD 14\)' 'set(CMAKE_CXX_STANDARD 17)'
patch_file "$src/horovod/tensorflow/CMakeLists.txt" '^list\(APPEND TF_SOURCES "\$\{PROJECT_SOURCE_DIR\}/horovod/tensorflow/xla_mpi_ops.cc"\)\n' ''

export HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MXNET=1
case " $FRAMEWORKS " in *" torch "*) export HOROVOD_WITH_PYTORCH=1;; *) export HOROVOD_WITHOUT_PYTORCH=1;; esac
case " $FRAMEWORKS " in *" tensorflow "*) export HOROVOD_WITH_TENSORFLOW=1;; *) export HOROVOD_WITHOUT_TENSORFLOW=1;; esac
# CPU tensor operations are left to Horovod's default: both MPI and Gloo ops are built and the
# controller chosen at launch (horovodrun --mpi / --gloo) picks its own.
if [[ "${HVDP_GPU:-0}" == 1 ]]; then
    export HOROVOD_GPU_OPERATIONS=NCCL
fi
export MAKEFLAGS=${MAKEFLAGS:--j$(nproc)}
mkdir -p "$OUT"
"$PY" -m pip wheel --no-build-isolation --no-deps -w "$OUT" "$src"
