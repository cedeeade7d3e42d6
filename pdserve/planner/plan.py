"""`pdserve plan`: the roofline model applied to one model, one device and one workload.

`build_plan` returns a plain dict whose keys are the documented, stable `--json` fields
(docs/planner.md); `format_plan` renders the same dict as readable tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from fractions import Fraction

from pdserve_core.roofline import model as rf
from pdserve_core.roofline.specs import DeviceSpec, ModelSpec
from pdserve_core.roofline.stepmodel import Calibration, StepModel, step_cost

CHUNK_AMORTIZED = 1.1
"""A calibrated chunk is large enough once its per-token cost is within 10 % of a long chunk's
(the step overhead is paid off)."""
LONG_CHUNK = 8192


@dataclass(frozen=True)
class Workload:
    batch: int = 1
    prompt_len: int = 1024
    output_len: int = 256
    context: int | None = None
    """Tokens of KV per sequence for the memory check; None: prompt_len + output_len."""
    rate: float = 1.0
    """Requests per second to size the pools for."""
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("batch", "prompt_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.context is not None and self.context < 1:
            raise ValueError("context must be at least 1")
        if self.rate <= 0:
            raise ValueError("rate must be positive")

    @property
    def kv_context(self) -> int:
        return self.context or self.prompt_len + self.output_len


def _layer_rows(m: ModelSpec, device: DeviceSpec, w: Workload) -> list[dict]:
    ridge = rf.ridge_point(device)
    rows = []
    for phase, tokens in (("prefill", w.batch * w.prompt_len), ("decode", w.batch)):
        for op in rf.linear_ops(m, tokens):
            rows.append(
                {
                    "phase": phase,
                    "layer": op.name,
                    "tokens": tokens,
                    "flops": op.flops,
                    "weight_bytes": op.bytes,
                    "intensity": op.intensity,
                    "bound": "compute" if op.intensity >= ridge else "memory",
                }
            )
    return rows


def _ratio(prefill: int, decode: int) -> str:
    if not decode:
        return f"{prefill}:0"
    frac = Fraction(prefill, decode)
    return f"{frac.numerator}:{frac.denominator}"


def calibrated_prefill(step: StepModel, m: ModelSpec, batch: int, prompt: int, chunk: int) -> float:
    """Seconds to prefill `batch` prompts of `prompt` tokens on an engine computing up to
    `chunk` tokens per step (short prompts share a step; long ones run chunk by chunk)."""
    if prompt >= chunk:
        return batch * step.prefill_seconds(m, prompt, chunk)
    per_step = max(1, chunk // prompt)
    full, rest = divmod(batch, per_step)
    seconds = full * step.period_seconds(step_cost(m, per_step * prompt, per_step, 0, 0, 0))
    if rest:
        seconds += step.period_seconds(step_cost(m, rest * prompt, rest, 0, 0, 0))
    return seconds


def calibrated_chunk(step: StepModel, m: ModelSpec) -> int:
    """Smallest power of two whose per-token prefill cost (attention aside: it grows with the
    prompt, not the chunk) is within `CHUNK_AMORTIZED` of a long chunk's: below it, the per-step
    overhead is a visible share of every chunk."""

    def per_token(tokens: int) -> float:
        cost = step_cost(m, tokens, 1, 0, 0, 0)
        return step.cost_seconds(replace(cost, attention_flops=0.0)) / tokens

    floor = per_token(LONG_CHUNK)
    chunk = 1
    while chunk < LONG_CHUNK and per_token(chunk) > CHUNK_AMORTIZED * floor:
        chunk *= 2
    return chunk


def decode_batch_at_rate(rate: float, output: int, step_s, limit: int = 4096) -> float:
    """Sequences a decode engine holds at `rate` requests/s of `output` tokens (Little's law:
    batch = rate × output × step time, the step time itself depending on the batch), found by
    fixed-point iteration; `limit` when the engine cannot keep up."""
    batch = 1.0
    for _ in range(100):
        nxt = max(1.0, rate * output * step_s(max(1, round(batch))))
        if nxt > limit:
            return float(limit)
        if abs(nxt - batch) < 1e-3:
            break
        batch = nxt
    return batch


@dataclass(frozen=True)
class _Costs:
    """What a plan's estimates are drawn from: the roofline at peak, or a calibration's fitted
    step-time model."""

    chunk: int
    ttft_s: float
    tpot_s: float
    pools: rf.PoolPlan
    decode_step_s: Callable[[int, int], float]
    """Seconds of one decode step at (batch, context)."""
    calibrated: dict | None = None
    """The calibration's record for the plan (None: the roofline)."""


def _roofline_costs(m: ModelSpec, device: DeviceSpec, w: Workload) -> _Costs:
    return _Costs(
        chunk=rf.recommended_chunk(m, device),
        ttft_s=rf.prefill_seconds(m, device, w.batch, w.prompt_len),
        tpot_s=rf.decode_step_seconds(m, device, w.batch, w.prompt_len + w.output_len // 2),
        pools=rf.plan_pools(m, device, w.prompt_len, w.output_len, w.rate, w.tpot_slo_s),
        decode_step_s=lambda batch, ctx: rf.decode_step_seconds(m, device, batch, ctx),
    )


def _calibrated_costs(
    m: ModelSpec, device: DeviceSpec, w: Workload, calibration: Calibration
) -> _Costs:
    step = calibration.for_role("prefill")
    decode_step = calibration.for_role("decode")
    engine_chunk = int(calibration.engine.get("max_num_batched_tokens") or 2048)
    first_s = float(calibration.engine.get("request_overhead_s") or 0.0)

    def decode_step_s(batch: int, ctx: int) -> float:
        return decode_step.decode_step_seconds(m, batch, ctx)

    return _Costs(
        chunk=calibrated_chunk(step, m),
        ttft_s=first_s + calibrated_prefill(step, m, w.batch, w.prompt_len, engine_chunk),
        tpot_s=decode_step_s(w.batch, w.prompt_len + w.output_len // 2),
        pools=rf.plan_pools(
            m,
            device,
            w.prompt_len,
            w.output_len,
            w.rate,
            w.tpot_slo_s,
            prefill_s=lambda length: calibrated_prefill(step, m, 1, length, engine_chunk),
            decode_s=decode_step_s,
        ),
        decode_step_s=decode_step_s,
        calibrated={
            "path": str(calibration.path) if calibration.path else None,
            "device": calibration.device,
            "step_model": calibration.step_model.to_dict(),
            "roles": {role: s.to_dict() for role, s in (calibration.roles or {}).items()},
            "fit": calibration.fit,
            "engine_chunk_tokens": engine_chunk,
            "request_overhead_s": first_s,
        },
    )


def build_plan(
    m: ModelSpec, device: DeviceSpec, w: Workload, calibration: Calibration | None = None
) -> dict:
    """The plan; with `calibration`, TTFT / TPOT / chunk / P:D come from its step-time model
    (fitted on this device and model) instead of the roofline at peak."""
    ridge = rf.ridge_point(device)
    kv_token = rf.kv_bytes_per_token(m)
    free = rf.kv_capacity_bytes(m, device)
    needed = w.batch * w.kv_context * kv_token
    largest = rf.max_batch(m, device, w.kv_context)
    transfer = rf.kv_transfer_seconds(m, device, w.prompt_len)
    costs = (
        _roofline_costs(m, device, w)
        if calibration is None
        else _calibrated_costs(m, device, w, calibration)
    )
    chunk, ttft, tpot = costs.chunk, costs.ttft_s, costs.tpot_s
    pools, calibrated = costs.pools, costs.calibrated
    mid = w.prompt_len + w.output_len // 2

    def at_rate(batch: int) -> float:
        return costs.decode_step_s(batch, mid)

    # each of the plan's decode devices takes its share of the rate
    per_device = w.rate / max(1, pools.decode_devices)
    batch_at_rate = decode_batch_at_rate(per_device, w.output_len, at_rate, max(1, largest))
    tpot_at_rate = at_rate(max(1, round(batch_at_rate)))
    threshold = rf.compute_bound_tokens(m, device)
    prefill_ai = rf.linear_intensity(m, w.batch * w.prompt_len)
    decode_ai = rf.linear_intensity(m, w.batch)
    reasoning = [
        f"ridge point {ridge:.0f} FLOP/B: linear layers turn compute-bound at {threshold} tokens "
        f"per step",
        f"prefill runs {w.batch * w.prompt_len} tokens (AI {prefill_ai:.0f}): "
        + ("compute-bound" if prefill_ai >= ridge else "memory-bound (short prompt, small batch)"),
        f"decode runs {w.batch} tokens (AI {decode_ai:.0f}): "
        + ("compute-bound" if decode_ai >= ridge else f"memory-bound until batch {threshold}"),
        (
            f"chunk {chunk}: the smallest power of two whose per-token cost is within "
            f"{CHUNK_AMORTIZED - 1:.0%} of a long chunk's (the measured step overhead is paid off)"
            if calibrated
            else f"chunk {chunk}: the smallest power of two at or above {threshold} tokens keeps "
            f"chunks compute-bound"
        ),
        f"batch {w.batch} at {w.kv_context} tokens needs {needed / 1e9:.2f} GB of KV; "
        f"{max(free, 0) / 1e9:.1f} GB is free after weights: "
        + ("fits" if needed <= free else f"does not fit (largest batch {largest})"),
        f"one prefill device sustains {pools.prefill_requests_per_s:.2f} req/s and one decode "
        f"device {pools.decode_requests_per_s:.2f} req/s at batch {pools.decode_batch}, so "
        f"{w.rate:g} req/s needs {pools.prefill_devices} prefill : {pools.decode_devices} decode",
    ]
    if w.ttft_slo_s is not None and ttft > w.ttft_slo_s:
        reasoning.append(f"TTFT {ttft * 1e3:.1f} ms misses the {w.ttft_slo_s * 1e3:.0f} ms SLO")
    if w.tpot_slo_s is not None and tpot > w.tpot_slo_s:
        reasoning.append(f"TPOT {tpot * 1e3:.1f} ms misses the {w.tpot_slo_s * 1e3:.0f} ms SLO")
    return {
        "model": {
            "name": m.name,
            "parameters": rf.parameter_count(m),
            "weight_bytes": rf.weight_bytes(m),
            "dtype_bytes": m.dtype_bytes,
            "kv_bytes_per_token": kv_token,
        },
        "device": asdict(device),
        "workload": {**asdict(w), "context": w.kv_context},
        "ridge_point": ridge,
        "layers": _layer_rows(m, device, w),
        "decode_compute_bound_batch": threshold,
        "memory": {
            "kv_free_bytes": free,
            "kv_needed_bytes": needed,
            "fits": needed <= free,
            "max_batch": largest,
        },
        "chunk": {"recommended_tokens": chunk, "intensity": rf.linear_intensity(m, chunk)},
        "estimates": {
            "ttft_s": ttft,
            "tpot_s": tpot,
            "kv_transfer_s": transfer,
            "source": "calibrated" if calibrated else "roofline",
            "decode_batch_at_rate": batch_at_rate,
            "tpot_at_rate_s": tpot_at_rate,
        },
        "calibration": calibrated,
        "pools": {
            "prefill_devices": pools.prefill_devices,
            "decode_devices": pools.decode_devices,
            "ratio": _ratio(pools.prefill_devices, pools.decode_devices),
            "decode_batch": pools.decode_batch,
            "prefill_requests_per_s": pools.prefill_requests_per_s,
            "decode_requests_per_s": pools.decode_requests_per_s,
        },
        "reasoning": reasoning,
    }


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 10 else f"{seconds:.1f} s"


def format_plan(plan: dict) -> str:
    m, d, w = plan["model"], plan["device"], plan["workload"]
    lines = [
        f"model  {m['name']}: {m['parameters'] / 1e9:.2f} B params, "
        f"{_si(m['weight_bytes'], 'B')} weights, KV {m['kv_bytes_per_token'] / 1024:.0f} KiB/token",
        f"device {d['name']}: {_si(d['peak_flops'], 'FLOP/s')}, {_si(d['mem_bandwidth'], 'B/s')}, "
        f"{_si(d['mem_capacity'], 'B')}, link {_si(d['interconnect_bandwidth'], 'B/s')}",
        f"load   batch {w['batch']}, prompt {w['prompt_len']}, output {w['output_len']}, "
        f"context {w['context']}, rate {w['rate']:g} req/s",
        "",
        f"{'phase':<8}{'layer':<11}{'tokens':>8}{'FLOPs':>13}{'weights':>12}{'AI':>9}  bound",
    ]
    for row in plan["layers"]:
        lines.append(
            f"{row['phase']:<8}{row['layer']:<11}{row['tokens']:>8}{_si(row['flops'], ''):>13}"
            f"{_si(row['weight_bytes'], 'B'):>12}{row['intensity']:>9.1f}  {row['bound']}"
        )
    mem, est, pools, chunk = plan["memory"], plan["estimates"], plan["pools"], plan["chunk"]
    lines += [
        "",
        f"ridge point             {plan['ridge_point']:.1f} FLOP/B",
        f"decode compute-bound at batch {plan['decode_compute_bound_batch']}",
        f"KV free after weights   {_si(max(mem['kv_free_bytes'], 0), 'B')}",
        f"KV for this batch       {_si(mem['kv_needed_bytes'], 'B')} "
        f"({'fits' if mem['fits'] else 'DOES NOT FIT'}; largest batch {mem['max_batch']})",
        f"recommended chunk       {chunk['recommended_tokens']} tokens "
        f"(AI {chunk['intensity']:.0f})",
        f"{'TTFT (' + est['source'] + ')':<24}{_ms(est['ttft_s'])}",
        f"{'TPOT (' + est['source'] + ')':<24}{_ms(est['tpot_s'])}",
        f"{'TPOT at ' + format(w['rate'], 'g') + ' req/s':<24}{_ms(est['tpot_at_rate_s'])} (each "
        f"of {pools['decode_devices']} decode devices holds {est['decode_batch_at_rate']:.1f} "
        "sequences)",
        f"KV transfer / request   {_ms(est['kv_transfer_s'])}",
        f"P:D                     {pools['ratio']} ({pools['prefill_devices']} prefill, "
        f"{pools['decode_devices']} decode; decode batch {pools['decode_batch']})",
        *_calibration_lines(plan.get("calibration")),
        "",
        "why:",
        *[f"  - {reason}" for reason in plan["reasoning"]],
    ]
    return "\n".join(lines)


def _calibration_lines(calibrated: dict | None) -> list[str]:
    if not calibrated:
        return []
    step, fit = calibrated["step_model"], calibrated["fit"]
    return [
        "",
        f"step-time model         calibrated on {calibrated['device']} ({calibrated['path']})",
        f"  overhead {step['overhead_s'] * 1e3:.2f} ms/step + {step['per_sequence_s'] * 1e3:.3f} "
        f"ms/sequence; achieved {_si(step['flops'], 'FLOP/s')}, "
        f"{_si(step['mem_bandwidth'], 'B/s')}",
        *[
            f"  {role} engines: {s['overhead_s'] * 1e3:.2f} ms/step + "
            f"{s['per_sequence_s'] * 1e3:.3f} ms/sequence, {_si(s['flops'], 'FLOP/s')}, "
            f"{_si(s['mem_bandwidth'], 'B/s')}"
            for role, s in calibrated.get("roles", {}).items()
        ],
        f"  fit over {fit.get('steps')} steps: median error {fit.get('median_error', 0):.1%}, "
        f"p90 {fit.get('p90_error', 0):.1%}; router adds "
        f"{calibrated['request_overhead_s'] * 1e3:.0f} ms to TTFT",
    ]


def plot_plan(plan: dict, path: str) -> None:
    """Roofline chart: both roofs, the ridge, and the prefill, decode and chunk points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = plan["device"]
    peak, bw, ridge = d["peak_flops"], d["mem_bandwidth"], plan["ridge_point"]
    rows = {row["phase"]: row for row in plan["layers"] if row["layer"] == "gate_proj"}
    points = [
        ("prefill", rows["prefill"]["intensity"], "tab:red"),
        ("decode", rows["decode"]["intensity"], "tab:blue"),
        ("chunk", plan["chunk"]["intensity"], "tab:green"),
    ]
    low = min(0.5, min(p[1] for p in points) / 2)
    high = max(ridge * 8, max(p[1] for p in points) * 2)
    xs = [low * (high / low) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    ax.loglog(xs, [min(peak, bw * x) / 1e12 for x in xs], color="black", label="attainable")
    ax.axhline(
        peak / 1e12, color="grey", linestyle=":", label=f"compute roof {peak / 1e12:.0f} TFLOP/s"
    )
    ax.loglog(xs, [bw * x / 1e12 for x in xs], color="grey", linestyle="--", label="bandwidth roof")
    ax.axvline(ridge, color="orange", linestyle="-.", label=f"ridge {ridge:.0f} FLOP/B")
    for label, ai, color in points:
        ax.scatter([ai], [min(peak, bw * ai) / 1e12], color=color, s=60, zorder=3)
        ax.annotate(
            f"{label} (AI {ai:.0f})",
            (ai, min(peak, bw * ai) / 1e12),
            textcoords="offset points",
            xytext=(6, -12),
            fontsize=9,
        )
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(f"{plan['model']['name']} on {d['name']}: roofline")
    ax.set_ylim(bottom=min(bw * low, peak) / 1e12 / 2, top=peak / 1e12 * 2)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
