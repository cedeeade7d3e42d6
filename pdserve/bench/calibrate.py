"""`pdserve plan calibrate`: run a known spread of step shapes through a pdserve cluster, read the
engines' own per-step records back (GET /pdserve/v1/steps) and fit the step-time model
(pdserve_core.roofline.stepmodel) per device and model.

The traffic covers what the fit must tell apart:
- prompts one at a time, from a few tokens to a long one, while a few long streams decode
  beside them: the overhead, the linear layers' compute rate and the causal attention over
  growing chunks, measured with the router busy streaming tokens as it is when serving (on a
  small machine the router shares the engines' cores; a quiet router made prefill look 10-25 %
  faster than under load);
- decode batches of growing size, short and long contexts: the per-sequence cost, the weights'
  bandwidth and the attention over each sequence's cache.
Every request runs through the router, so the steps are the ones serving runs: same engines, same
threads, the router on the same cores.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.bench.client import send, served_model
from pdserve.bench.stats import RequestRecord
from pdserve.bench.workload import TOKEN_RANGE, RequestSpec
from pdserve.planner.fit import Fit, fit, save_calibration
from pdserve_core.roofline.specs import ModelSpec
from pdserve_core.roofline.stepmodel import FitError, StepModel, StepRecord, calibration_path

logger = logging.getLogger(__name__)

PROMPTS = (8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536)
"""Prompt lengths sent one at a time (each twice)."""
BACKGROUND = (4, 64, 200)
"""(streams, prompt tokens, output tokens) decoding beside the prompts, restarted as they end."""
BATCHES = ((2, 64), (4, 64), (8, 64), (16, 64), (32, 64), (48, 64), (8, 1024), (4, 1536))
"""(concurrent requests, prompt tokens) of the decode bursts."""
OUTPUT_TOKENS = 48


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(length)]


async def drive(
    url: str, api_key: str | None = None, timeout_s: float = 300.0
) -> list[RequestRecord]:
    """Send the calibration traffic; returns the records of the prompts sent one at a time (what
    the router adds to a request's latency is measured from them) and raises if any request
    fails."""
    model = await served_model(url, api_key)
    rng = random.Random(0)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    failed, index, alone = 0, 0, []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s) as http:
        loop = asyncio.get_running_loop()
        start = loop.time()
        done = asyncio.Event()
        background_failed = 0

        async def stream(slot: int) -> None:
            nonlocal background_failed
            streams, length, output = BACKGROUND
            while not done.is_set():
                spec = RequestSpec(-1 - slot, _prompt(rng, length), output)
                record = await send(http, spec, model, start, timeout_s)
                background_failed += record.error is not None

        background = [asyncio.create_task(stream(slot)) for slot in range(BACKGROUND[0])]
        for length in PROMPTS:
            for _ in range(2):
                spec = RequestSpec(index, _prompt(rng, length), 16)
                record = await send(http, spec, model, start, timeout_s)
                failed += record.error is not None
                alone.append(record)
                index += 1
        done.set()
        await asyncio.gather(*background)
        failed += background_failed
        for batch, length in BATCHES:
            specs = [
                RequestSpec(index + i, _prompt(rng, length), OUTPUT_TOKENS) for i in range(batch)
            ]
            index += batch
            records = await asyncio.gather(
                *(send(http, spec, model, start, timeout_s) for spec in specs)
            )
            failed += sum(r.error is not None for r in records)
    if failed:
        raise RuntimeError(f"{failed} calibration requests failed (see the server's log)")
    return alone


def request_overhead(
    prefill: StepModel, m: ModelSpec, chunk: int, alone: list[RequestRecord]
) -> float:
    """What a first token sees beyond the engine steps, from the prompts sent one at a time: the
    median of TTFT − predicted prefill (the router, the hand-off, the token's trip back). Later
    tokens pay the router's trip too, but as latency, not cadence: the router relays one token
    while the engine computes the next, so ITL and TPOT are the engine's step times (which the
    step model is fitted on, contention from the router included)."""
    from pdserve.bench.stats import percentile

    first = [
        record.ttft - prefill.prefill_seconds(m, record.prompt_tokens, chunk)
        for record in alone
        if record.ok and record.ttft is not None
    ]
    return max(0.0, percentile(first, 50) or 0.0)


def fetch_steps(url: str, api_key: str | None = None) -> list[dict]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{url}/pdserve/v1/steps", headers=headers, timeout=60)
    response.raise_for_status()
    return response.json()["nodes"]


@dataclass(frozen=True)
class Calibrated:
    device: str
    model: str
    nodes: list[str]
    fit: Fit
    path: Path
    roles: dict[str, Fit]


def fit_nodes(
    nodes: list[dict],
    out: Path | None = None,
    skip_steps: int = 0,
    alone: list[RequestRecord] | None = None,
) -> list[Calibrated]:
    """One fit per (device, model) over the records of every node that shares them; saved under
    `out` (a folder) or the cache (where engines look at start). `skip_steps`: per node, the
    first steps left out (a warm-up). `alone`: requests served one at a time, to measure what a
    request pays beyond its steps."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for node in nodes:
        if node.get("model_spec") and node.get("device"):
            groups[(node["device"], node["model"])].append(node)
    results = []
    for (device, model), members in sorted(groups.items()):
        spec = ModelSpec(**{**members[0]["model_spec"], "name": model})
        by_role: dict[str, list[StepRecord]] = defaultdict(list)
        for node in members:
            role = node.get("role") or node["pool"]
            by_role[role] += [StepRecord.from_list(row) for row in node["records"][skip_steps:]]
        records = [record for rows in by_role.values() for record in rows]
        result = fit(spec, records, source="calibrated")
        roles = {}
        for role, rows in by_role.items():
            if len(by_role) == 1:
                break  # one role: the shared fit is its fit
            try:
                roles[role] = fit(spec, rows, source=f"calibrated#{role}")
            except FitError as error:
                logger.info("no %s fit of its own (%s): it uses the shared one", role, error)
        path = calibration_path(device, model, out)
        chunk = int(members[0].get("max_num_batched_tokens") or 2048)
        engine = {
            "max_num_batched_tokens": chunk,
            "max_num_seqs": members[0].get("max_num_seqs"),
            "nodes": [f"{n['pool']}/{n['node']}" for n in members],
        }
        if alone:
            engine["request_overhead_s"] = request_overhead(
                (roles.get("prefill") or result).model, spec, chunk, alone
            )
        save_calibration(path, device, spec, result, engine, roles)
        results.append(Calibrated(device, model, engine["nodes"], result, path, roles))
    return results
