"""Fitting the step-time model (pdserve_core/roofline/stepmodel.py) to the steps an engine ran, and
storing the result: `pdserve plan calibrate`'s work, the planner's side of calibration.

`fit` finds the coefficients from per-step records (tokens, sequences, context, seconds): for a
grid of compute/bandwidth ratios it solves a non-negative least-squares problem in relative error
(a 30 ms decode step counts as much as a 3 s prefill step), and keeps the best. The gap between
steps is the records' mean gap (a cadence is a sum of periods, so the mean is what it pays).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve_core.roofline.specs import GB, GIB, DeviceSpec, ModelSpec
from pdserve_core.roofline.stepmodel import (
    CALIBRATION_VERSION,
    Calibration,
    FitError,
    StepModel,
    StepRecord,
    step_cost,
)

RATIO_GRID = [10 ** (i / 20) for i in range(-20, 101)]
"""Compute/bandwidth ratios (FLOP/B) the fit tries: 0.1 to 100 000, 20 per decade."""


@dataclass(frozen=True)
class Fit:
    model: StepModel
    steps: int
    """Records the fit used."""
    median_error: float
    """Median |predicted - measured| / measured over them."""
    p90_error: float


MIN_STEPS = 20


def fit(m: ModelSpec, records: Iterable[StepRecord], source: str = "calibrated") -> Fit:
    """Least relative squared error over the coefficients (all ≥ 0), for each ratio of the grid."""
    import numpy as np

    rows = [r for r in records if r.seconds > 0 and r.prompt_tokens + r.decode_tokens > 0]
    if len(rows) < MIN_STEPS:
        raise FitError(f"{len(rows)} step records; the fit needs at least {MIN_STEPS}")
    costs = [
        step_cost(
            m,
            r.prompt_tokens,
            r.prompt_sequences,
            r.decode_tokens,
            r.decode_sequences,
            r.context_tokens,
        )
        for r in rows
    ]
    seconds = np.array([r.seconds for r in rows])
    weight = 1.0 / seconds
    ones = np.ones(len(rows))
    sequences = np.array([c.sequences for c in costs], dtype=float)
    linear = np.array([c.linear_flops for c in costs])
    moved = np.array([c.bytes for c in costs])
    attention = np.array([c.attention_flops for c in costs])
    best: tuple[float, float, np.ndarray] | None = None
    for ratio in RATIO_GRID:
        roof = np.maximum(linear / ratio, moved)  # seconds × bandwidth
        columns = np.stack([ones, sequences, roof, attention], axis=1)
        coefficients = _nnls(columns * weight[:, None], ones)
        if coefficients is None or coefficients[2] <= 0:
            continue
        residual = float(np.sum((columns @ coefficients * weight - 1.0) ** 2))
        if best is None or residual < best[0]:
            best = (residual, ratio, coefficients)
    if best is None:
        raise FitError("no fit with a positive roofline term (are all steps identical?)")
    _, ratio, (overhead, per_sequence, inverse_bw, inverse_attention) = best
    bandwidth = 1.0 / inverse_bw
    gaps = [r.gap_seconds for r in rows if r.gap_seconds is not None]
    model = StepModel(
        float(overhead),
        float(per_sequence),
        ratio * bandwidth,
        bandwidth,
        float(inverse_attention),
        source,
        max(0.0, sum(gaps) / len(gaps)) if gaps else 0.0,
    )
    errors = sorted(
        abs(model.cost_seconds(c) - r.seconds) / r.seconds for c, r in zip(costs, rows, strict=True)
    )
    return Fit(model, len(rows), _quantile(errors, 0.5), _quantile(errors, 0.9))


def _quantile(ordered: Sequence[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _nnls(a, b):
    """Non-negative least squares for a handful of columns: the best unconstrained solution over
    every subset of columns whose coefficients all come out ≥ 0 (exact for ≤ 6 columns)."""
    import numpy as np

    n = a.shape[1]
    best, best_residual = None, math.inf
    for size in range(1, n + 1):
        for subset in itertools.combinations(range(n), size):
            sub = a[:, subset]
            solution, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(solution < 0):
                continue
            residual = float(np.sum((sub @ solution - b) ** 2))
            if residual < best_residual:
                full = np.zeros(n)
                full[list(subset)] = solution
                best, best_residual = full, residual
    return best


def _fit_dict(result: Fit) -> dict:
    return {
        "steps": result.steps,
        "median_error": result.median_error,
        "p90_error": result.p90_error,
    }


def save_calibration(
    path: Path,
    device: str,
    model: ModelSpec,
    result: Fit,
    engine: dict | None = None,
    roles: dict[str, Fit] | None = None,
) -> Path:
    """`result`: the fit over every engine of this device and model; `roles`: fits over one
    role's engines ("prefill", "decode", "colocated"), which see different work and, on shared
    machines, different neighbours."""
    import time

    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "version": CALIBRATION_VERSION,
        "device": device,
        "model": asdict(model),
        "step_model": result.model.to_dict(),
        "fit": _fit_dict(result),
        "roles": {
            role: {"step_model": fit.model.to_dict(), "fit": _fit_dict(fit)}
            for role, fit in (roles or {}).items()
        },
        "engine": engine or {},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


DEFAULT_KV_GIB = 2
"""KV cache assumed next to the weights when a calibrated device's memory is not given (pdserve's
CPU engines' `kv_cache_space_gib`)."""
DEFAULT_LINK_GBS = 1.0


def calibration_device(
    calibration: Calibration,
    memory_gb: float | None = None,
    interconnect_gbs: float | None = None,
    model: ModelSpec | None = None,
) -> DeviceSpec:
    """A device described by what the calibration measured: its achieved rates as the roofs,
    memory for the weights plus `DEFAULT_KV_GIB` of KV unless given, and the P→D link."""
    from pdserve_core.roofline.model import weight_bytes as weights

    step = calibration.step_model
    if memory_gb:
        memory = memory_gb * GB
    else:  # the plan's KV check uses 90 % of memory: this leaves the KV what the engines have
        memory = (weights(model or calibration.model) + DEFAULT_KV_GIB * GIB) / 0.9
    return DeviceSpec(
        calibration.device,
        step.flops,
        step.mem_bandwidth,
        memory,
        (interconnect_gbs or DEFAULT_LINK_GBS) * GB,
    )
