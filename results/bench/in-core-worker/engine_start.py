"""One engine built with its model worker in a process of its own (`mp`) or inside the EngineCore
(`uni`: vLLM's one-process executor named by its class): `python engine_start.py mp` / `uni`."""
import asyncio, sys, time, os
t0 = time.monotonic()
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM
from vllm import SamplingParams
t1 = time.monotonic()
kw = dict(model=os.path.expanduser("~/.cache/pdserve/models/SmolLM2-135M-Instruct"), enforce_eager=True, dtype="float32", kv_cache_memory_bytes=1<<30)
if sys.argv[1] == "uni":
    from vllm.v1.executor.uniproc_executor import UniProcExecutor
    kw["distributed_executor_backend"] = UniProcExecutor
async def main():
    eng = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
    t2 = time.monotonic()
    out = None
    async for o in eng.generate("Hello, my name is", SamplingParams(max_tokens=16, temperature=0), "r1"):
        out = o
    t3 = time.monotonic()
    print(sys.argv[1], f"import {t1-t0:.1f} build {t2-t1:.1f} first {t3-t2:.1f}", repr(out.outputs[0].text), flush=True)
    eng.shutdown()
    print(f"shutdown {time.monotonic()-t3:.1f}")
if __name__ == "__main__":
    asyncio.run(main())
