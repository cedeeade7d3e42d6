#!/usr/bin/env bash
# The GPU checks, in one run on a GPU machine that has torch and CUDA but no package registry.
#   bash scripts/gpu_check.sh pack     # here, with PyPI: NIXL and protobuf into .whl/ (17 MB)
#   bash scripts/gpu_check.sh 2>&1 | tee "$OUT/log"   # there, with .whl/ carried along
# NIXL travels as a stripped copy of the nixl-cu13 wheel for Python 3.12 (.whl/nixl.zip: its
# module, NIXL's UCX plugin and UCX; the EP kernels, storage plugins and perftests left out, 59 MB
# to 17), protobuf as its wheel. Figures go to $OUT (default results/gpu-check):
#   - the catalog entry pdserve detects for the GPU and the peaks its utilization would divide by;
#   - benchmarks/gpu_roofline.py for LLaMA-3 8B's and 70B's MLP projection (GEMV to GEMM);
#   - benchmarks/nixl_gpu.py: KV blocks pulled between two processes' CUDA caches by the nixl
#     plane (pdserve's UCX defaults), the same held to host-staged copies, and pdserve's TCP plane,
#     every byte compared.
# Results of 2026-12-04: results/plan/gpu, results/nixl_gpu.
set -u
if [ "${1:-}" = pack ]; then
    set -e
    work=$(mktemp -d)
    get() {
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
            -d "$work" "$@"
    }
    get nixl-cu13==1.5.1
    get protobuf==7.36.2
    mkdir -p .whl "$work/nixl"  # .gitignore'd: the device call carries it (carry: [".whl"])
    cp "$work"/protobuf-*.whl .whl/
    (
        cd "$work/nixl"
        python3 -m zipfile -e "$work"/nixl_cu13-*.whl .
        rm -rf nixl_ep_cu13 nixl_cu13-*.data nixl_cu13.scripts nixl_cu13.libs/ucx/libucx_perftest*
        for plugin in nixl_cu13.libs/nixl/* .nixl_cu13.mesonpy.libs/plugins/*; do
            case $plugin in *UCX* | *POSIX*) ;; *) rm "$plugin" ;; esac
        done
        rm -f nixl_cu13.libs/libaws-cpp-sdk-s3-* nixl_cu13.libs/libazure-* \
            nixl_cu13.libs/libgusli_clnt-* nixl_cu13.libs/libxml2-*
        python3 - "$work/nixl.zip" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1], "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
    for top in sorted(os.listdir(".")):
        for folder, _, names in os.walk(top):
            for name in names:
                out.write(os.path.join(folder, name))
PY
    )
    mv "$work/nixl.zip" .whl/nixl.zip
    rm -rf "$work"
    ls -l .whl
    exit 0
fi
OUT=${OUT:-results/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    site=/tmp/pdserve-site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl || exit 1
    [ -f .whl/nixl.zip ] && python3 -m zipfile -e .whl/nixl.zip "$site"
    export PYTHONPATH="$site"
fi

step() {  # name, timeout in seconds, command...: run it, log it, keep going on failure
    local name=$1 limit=$2
    shift 2
    echo "==> $name"
    local started=$SECONDS
    timeout "$limit" "$@" 2>&1
    echo "==> $name: rc $? in $((SECONDS - started)) s"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
step peaks 60 python3 -c "
import logging, torch
logging.basicConfig(level=logging.INFO)
from pdserve_core.roofline.serving import detect_device
from pdserve_core.roofline.live import resolve_peaks
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))
print('detected', detect_device(), resolve_peaks())
"
step roofline-8b 90 python3 benchmarks/gpu_roofline.py --device h200 --model llama-3-8b \
    --out "$OUT/roofline-8b"
step roofline-70b 90 python3 benchmarks/gpu_roofline.py --device h200 --model llama-3-70b \
    --out "$OUT/roofline-70b"
step nixl 100 python3 benchmarks/nixl_gpu.py --device cuda --out "$OUT/nixl.json"
UCX_TLS=tcp,cuda_copy step nixl-staged 100 python3 benchmarks/nixl_gpu.py --device cuda \
    --out "$OUT/nixl_staged.json"
step tcp 100 python3 benchmarks/nixl_gpu.py --device cuda --plane tcp --out "$OUT/tcp.json"
