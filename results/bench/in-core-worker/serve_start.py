"""A/B: pdserve serve (default 1P1D) ready time and a greedy answer, worker process vs not."""
import json, os, signal, subprocess, sys, time, pathlib, httpx, psutil
def run(flag, work):
    work = pathlib.Path(work); work.mkdir(parents=True, exist_ok=True)
    ready = work / "ready.json"; ready.unlink(missing_ok=True)
    log = open(work / "serve.log", "w")
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--port", "0", "--grpc-port", "0",
        "--ready-file", str(ready), "--dtype", "float32", "--set", f"engine.cpu_worker_process={flag}"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, VLLM_RPC_BASE_PATH=str(work)))
    while not (ready.exists() and ready.read_text()):
        assert p.poll() is None, (work / "serve.log").read_text()[-3000:]
        time.sleep(0.1)
    t1 = time.monotonic()
    info = json.loads(ready.read_text())
    url = info["url"] if "url" in info else info["http"]
    body = {"model": "default", "prompt": "Tell me a story about a dog.", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    m = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]; body["model"] = m
    texts, took = [], []
    for i in range(6):
        s = time.monotonic(); r = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json(); took.append(time.monotonic() - s)
        texts.append(r["choices"][0]["text"])
    procs = len(psutil.Process(p.pid).children(recursive=True))
    t2 = time.monotonic(); p.send_signal(signal.SIGTERM); p.wait(); t3 = time.monotonic()
    print(f"worker_process={flag}: ready {t1-t0:.1f} s, stop {t3-t2:.1f} s, procs {procs}, 64 tok: {sorted(took)[len(took)//2]:.2f} s median, same={len(set(texts))==1} {texts[0][:40]!r}", flush=True)
for flag in sys.argv[1:]:
    import tempfile
    run(flag, tempfile.mkdtemp(prefix=f"serve-{flag}-"))
