#!/usr/bin/env bash
# One prepared session on a lent GPU machine (no package index there): the Triton kernels against
# the numpy reference, codec throughput against the device's memcpy, then Horovod built with NCCL
# for that machine's own torch (python -m hvdp install-horovod --gpu, from a carried sdist) and
# examples/gpu_check.py. Every stage has its own time limit; logs go to OUTDIR.
#     bash scripts/gpu_session.sh OUTDIR HOROVOD_SDIST   (wheels in the sdist's folder are installed first)
set -uo pipefail
out=${1:?OUTDIR}; sdist=${2:?HOROVOD_SDIST}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-90}
stage() { local name=$1 limit=$2; shift 2; echo "=== $name"; local t0=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1; local rc=$?
    tail -n 40 "$out/$name.log"; echo "=== $name: rc $rc in $((SECONDS - t0)) s"; }
stage kernels_test 150 python3 -m pytest -q -p no:cacheprovider tests/unit/test_kernels_cuda.py
stage cuda_codecs 150 python3 benchmarks/cuda_codecs.py --json-out "$out/cuda_codecs.json"
stage pip_install 120 python3 -m pip install -q --no-deps --no-build-isolation --no-index .
# wheels carried beside the sdist (Horovod's build needs cffi, which that image lacks)
ls "$(dirname "$sdist")"/*.whl >/dev/null 2>&1 && stage pip_wheels 120 python3 -m pip install -q --no-index \
    --no-deps "$(dirname "$sdist")"/*.whl
stage install_horovod "${HVDP_BUILD_LIMIT:-420}" bash -c "cd /tmp && python3 -m hvdp install-horovod --gpu \
    --frameworks torch --sdist '$PWD/$sdist' --cache-dir /tmp/hvdp-wheels"
cp /tmp/hvdp-wheels/*/build.json /tmp/hvdp-wheels/build-*.log "$out/" 2>/dev/null
stage gpu_check 150 bash -c "cd /tmp && python3 '$PWD/examples/gpu_check.py'"
