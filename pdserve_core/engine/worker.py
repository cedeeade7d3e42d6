"""Methods vLLM adds to each of an engine's workers (`worker_extension_cls`, every engine gets
them), which the node's actor calls with `AsyncLLM.collective_rpc(name)`: the KV connector's
(pdserve_core/kv/worker_extension.py) and the engine's warm-up."""

from __future__ import annotations

import time

from pdserve_core.kv.worker_extension import KVWorkerExtension

QUALNAME = "pdserve_core.engine.worker.WorkerExtension"
"""What `engine_kwargs` passes vLLM as `worker_extension_cls`."""


class WorkerExtension(KVWorkerExtension):
    def pdserve_warm_sampler(self) -> float:
        """Compile the sampler's logprob-rank kernel now, before any request; returns the
        seconds it took.

        vLLM compiles it (`torch.compile`, even in eager mode) the first time a request asks for
        logprobs, inside that step: every stream on the engine stops meanwhile — 2.3 s on a
        2-core Xeon with inductor's cache warm, 11 s with it cold, as in a new container. The
        call here is the sampler's own, on tensors of its shape, dtype and grad mode, with the
        batch dimension left free as vLLM leaves it, so the steps that follow find it compiled."""
        import torch
        from torch._dynamo.decorators import mark_unbacked
        from vllm.v1.sample.ops.logprobs import batched_count_greater_than

        started = time.monotonic()
        vocab = self.model_config.get_vocab_size()
        with torch.inference_mode():
            logprobs = torch.zeros(2, vocab, dtype=torch.float32, device=self.device)
            chosen = logprobs[:, :1].contiguous()
            mark_unbacked(logprobs, 0)
            mark_unbacked(chosen, 0)
            batched_count_greater_than(logprobs, chosen)
        return time.monotonic() - started
