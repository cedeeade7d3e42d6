#!/usr/bin/env bash
# Run a command as on an AVX2-only x86 host, on a host with AVX-512 or AMX: an estimate of the
# slowest host kind CI may draw, for the suite's time (issue 37) or a benchmark.
#
#   sudo bash scripts/as_avx2_host.sh make test
#   sudo bash scripts/as_avx2_host.sh env CI=true bash .ci/run
#
# Inside, for the command and every process it starts (Ray's, the engines'):
# - /proc/cpuinfo lists no avx512*, amx* or avx_vnni* flag (a private mount namespace), so
#   `engine.dtype: native` resolves to float32, as on an AVX2-only host;
# - torch's own kernels, oneDNN and MKL are held to AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
#   MKL_ENABLE_INSTRUCTIONS), and vLLM loads its AVX2 build of its CPU kernels (`_C_AVX2`: a
#   `sitecustomize` on PYTHONPATH has torch.cpu answer that the CPU has no AVX-512 or AMX).
# Not emulated: the core's clock, caches and memory stay this host's. Read the result as an
# estimate; measure on a real AVX2-only host when one is drawn.
set -euo pipefail
if [ "$#" -eq 0 ]; then
  echo "usage: $0 COMMAND [ARG...]" >&2
  exit 2
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "$0: needs root (a private mount namespace over /proc/cpuinfo)" >&2
  exit 1
fi
here=$(mktemp -d /tmp/as-avx2-host.XXXXXX)
trap 'rm -rf "$here"' EXIT
sed -E 's/ (avx512[a-z0-9_]*|amx[a-z0-9_]*|avx_vnni[a-z0-9_]*)//g' /proc/cpuinfo > "$here/cpuinfo"
cat > "$here/sitecustomize.py" <<'PY'
"""torch.cpu says the CPU has no AVX-512 or AMX (vLLM picks its kernels' build by asking it)."""

import importlib.abc
import importlib.util
import sys


class AVX2Only(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for isa in ("avx512", "avx512_bf16", "avx512_vnni", "amx_tile"):
                setattr(module, f"_is_{isa}_supported", lambda: False)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, AVX2Only())
PY
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
unshare --mount --propagation private \
  bash -c 'mount --bind "$0" /proc/cpuinfo && exec "$@"' "$here/cpuinfo" "$@"
