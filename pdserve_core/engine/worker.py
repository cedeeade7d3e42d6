"""Methods vLLM adds to each of an engine's workers (`worker_extension_cls`, every engine gets
them), which the node's actor calls with `AsyncLLM.collective_rpc(name)`: the KV connector's
(pdserve_core/kv/worker_extension.py), the engine's warm-up and the mend of seeded sampling on
a CPU."""

from __future__ import annotations

import time
from typing import Any

from pdserve_core.kv.worker_extension import KVWorkerExtension

QUALNAME = "pdserve_core.engine.worker.WorkerExtension"
"""What `engine_kwargs` passes vLLM as `worker_extension_cls`."""


class WorkerExtension(KVWorkerExtension):
    def pdserve_keep_seeds_across_chunks(self) -> bool:
        """Mend this worker's model runner for seeded requests whose prompt a step splits
        (`keep_seeds_across_chunks`); False where vLLM's runner no longer has what the mend
        wraps."""
        return keep_seeds_across_chunks(self.model_runner)

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


def keep_seeds_across_chunks(runner: Any) -> bool:
    """Let a CPU engine sample a seeded request whose prompt is split across steps, and sample
    it as if the prompt had not been split.

    vLLM samples every request in a step and drops the token of one whose prompt is not yet
    whole (a chunk of a longer prompt), then rewinds that request's seeded generator, so the
    drop leaves no trace in what it samples later: `set_offset(get_offset() - 4)` in the runner's
    `_bookkeeping_sync`, the counter of CUDA's Philox generator. A CPU generator (a Mersenne
    twister) has no counter: the call raises "CPU Generator does not use offset", the EngineCore
    dies, and with it every stream on the node. Any client reaches it: a `seed` on a prompt that
    shares a step's token budget with others, or is longer than the budget.

    Here the runner keeps the state of each generator whose token the step will drop before it
    samples, puts it back after, and hides those generators from vLLM's rewind: the same
    outcome by the means a CPU generator has (`get_state`/`set_state`). True where seeded
    splits are safe: mended here, or not a CPU (vLLM's rewind works there)."""
    if getattr(runner, "device", None) is not None and runner.device.type != "cpu":
        return True
    if not all(
        hasattr(runner, a) for a in ("_sample", "_bookkeeping_sync", "discard_request_mask")
    ):
        return False
    import numpy as np

    sample, bookkeeping = runner._sample, runner._bookkeeping_sync

    def dropped() -> list[int]:
        """The rows of this step whose token is dropped and that carry a generator."""
        batch = runner.input_batch
        if not batch.generators:  # no seeded request in the step: nothing to keep
            return []
        rows = np.nonzero(runner.discard_request_mask.np[: batch.num_reqs])[0].tolist()
        return [row for row in rows if row in batch.generators]

    def _sample(*args: Any, **kwargs: Any) -> Any:
        generators = runner.input_batch.generators
        states = {row: generators[row].get_state() for row in dropped()}
        try:
            return sample(*args, **kwargs)
        finally:
            for row, state in states.items():
                generators[row].set_state(state)

    def _bookkeeping_sync(*args: Any, **kwargs: Any) -> Any:
        generators = runner.input_batch.generators
        hidden = {row: generators.pop(row) for row in dropped()}
        try:
            return bookkeeping(*args, **kwargs)
        finally:
            generators.update(hidden)

    runner._sample, runner._bookkeeping_sync = _sample, _bookkeeping_sync
    return True
