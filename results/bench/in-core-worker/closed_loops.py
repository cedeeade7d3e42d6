"""Closed loops (4 streams, 64 -> 128 tokens) against pdserve colocated (2 threads, cores 0-1):
the worker in the EngineCore (new) or in its own process (old), alternating."""
import asyncio, json, sys, yaml
from pathlib import Path
from pdserve.bench import compare
from pdserve.bench.client import run_load, served_model
from pdserve.bench.stats import summarize
from pdserve.bench.workload import RequestSpec, Workload, build_requests

async def loops(url, streams, n):
    model = await served_model(url)
    specs = build_requests(Workload("fixed", 64, 128), n, "fixed", 1.0, 7)
    specs = [RequestSpec(s.index, s.prompt_token_ids, s.max_tokens) for s in specs]
    await run_load(url, specs[:2], model, concurrency=1)
    records, duration = await run_load(url, specs, model, streams)
    s = summarize(records, duration, 1e9, 1e9)
    tokens = sum(r.output_tokens for r in records if r.ok)
    return {"tok_s": tokens / duration, "itl_p50_ms": s["itl_s"]["p50"] * 1e3, "ttft_p50_ms": s["ttft_s"]["p50"] * 1e3, "errors": s["errors"]}

import tempfile
out = Path(tempfile.mkdtemp(prefix="closed-loops-"))
for i, system in enumerate(sys.argv[1:]):
    work = compare.scratch(out, f"{i}-{system}")
    if system == "vllm":
        from pdserve_core.model_prep import prepare_default_model
        m = prepare_default_model()
        server = compare.plain_vllm_server(m, m.name, work)
    else:
        data = yaml.safe_load(compare.MODES["colocated"].read_text())
        data.setdefault("engine", {})["cpu_worker_process"] = system == "old"
        path = work / "c.yaml"; path.write_text(yaml.safe_dump(data))
        server = compare.pdserve_server(path, work)
    with server as url:
        r = {c: asyncio.run(loops(url, c, 6 if c == 1 else 4 * c)) for c in (1, 6)}
    print(i, system, json.dumps({c: {k: round(v, 1) for k, v in x.items()} for c, x in r.items()}), flush=True)
