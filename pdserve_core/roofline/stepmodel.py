"""The calibrated step-time model: what one engine step costs on this device, fitted from steps
the engine actually ran (docs/design.md, "The step-time model").

The roofline alone (`pdserve_core.roofline.model`) divides work by datasheet peaks and has no
cost per step, so it is a lower bound that a small model on a CPU misses by 2–5×. A step of a
vLLM engine costs

    t = overhead + per_sequence · sequences
        + max(linear FLOPs / achieved FLOP/s, bytes / achieved bytes/s)
        + attention FLOPs / achieved attention FLOP/s

- `overhead`: scheduling, Python, the sampler's launch, kernel launches: paid once per step;
- `per_sequence`: what each sequence in the step adds on top (its sampler row, its metadata);
- the roofline term: the linear layers and the LM head on the step's tokens, against the rates
  the device *achieves* on them (weights and KV read once per step, as `live.step_work` counts);
- the attention term: causal attention over each prompt chunk and each decode token's context.

The fit that finds the coefficients from the steps an engine ran is the planner's
(pdserve/planner/fit.py); this module is what an engine needs to price its steps.
`StepModel.roofline` is the uncalibrated model (no overhead, datasheet peaks): the planner's
tables without a calibration are the seed's, unchanged.

Calibrations are stored per device and model under the cache folder
(`calibration/<device>/<model>.json`); engines look theirs up at start (the live predicted/measured
step-time metrics) and `pdserve plan --calibration` reads one.
"""

from __future__ import annotations

import json
import os
import platform
import re
from collections.abc import Sequence
from dataclasses import asdict, astuple, dataclass
from pathlib import Path

from pdserve_core.roofline.model import kv_bytes_per_token, linear_ops, lm_head, weight_bytes
from pdserve_core.roofline.specs import ModelSpec

CALIBRATION_VERSION = 1


@dataclass(frozen=True)
class StepRecord:
    """One engine step as vLLM reported it (iteration details) and the actor's context count."""

    prompt_tokens: int
    prompt_sequences: int
    decode_tokens: int
    decode_sequences: int
    context_tokens: int
    """KV tokens held by the decoding sequences (each decode token attends to its own)."""
    seconds: float
    gap_seconds: float | None = None
    """Time between the previous step's end and this one's start, where the previous step left
    requests running (None where the engine may have idled): what the step's own time leaves out
    — the previous step's outputs handed on, this one scheduled — and a request's cadence pays."""

    @property
    def sequences(self) -> int:
        return self.prompt_sequences + self.decode_sequences

    def as_list(self) -> list:
        """The record as a row, its fields in order (the columns of GET /pdserve/v1/steps)."""
        return list(astuple(self))

    @classmethod
    def from_list(cls, row: Sequence) -> StepRecord:
        """A record as `as_list` wrote it (rows of six, from before gaps were kept, have none)."""
        p, ps, d, ds, ctx, s, *rest = row
        gap = float(rest[0]) if rest and rest[0] is not None else None
        return cls(int(p), int(ps), int(d), int(ds), int(ctx), float(s), gap)


@dataclass(frozen=True)
class StepCost:
    """The work of one step, split the way the step model charges it."""

    linear_flops: float
    attention_flops: float
    bytes: float
    sequences: int


def step_cost(
    m: ModelSpec,
    prompt_tokens: int,
    prompt_sequences: int,
    decode_tokens: int,
    decode_sequences: int,
    context_tokens: int,
) -> StepCost:
    """FLOPs and bytes of one step (what `live.step_work` sums for the utilization): linear layers
    2·tokens·d_in·d_out and the LM head per sequence; attention 4·heads·head_dim per attended
    token per layer; bytes = weights once per step, a prompt chunk's own K/V and each decode
    token's whole cache read, every new token's K/V written."""
    tokens = prompt_tokens + decode_tokens
    sequences = prompt_sequences + decode_sequences
    if tokens <= 0:
        return StepCost(0.0, 0.0, 0.0, 0)
    linear = m.num_layers * sum(op.flops for op in linear_ops(m, tokens))
    linear += lm_head(m, max(1, sequences)).flops
    # a causal chunk of P tokens attends to P/2 tokens on average (per prompt); a decode token
    # attends to its sequence's whole cache
    prompt_attended = prompt_tokens * prompt_tokens / (2 * max(1, prompt_sequences))
    decode_attended = decode_tokens * context_tokens / max(1, decode_sequences)
    attention = 4.0 * m.num_heads * m.head_dim * m.num_layers * (prompt_attended + decode_attended)
    kv = kv_bytes_per_token(m)
    moved = weight_bytes(m) + kv * (prompt_tokens + decode_attended) + kv * tokens
    return StepCost(linear, attention, float(moved), sequences)


@dataclass(frozen=True)
class StepModel:
    overhead_s: float
    per_sequence_s: float
    flops: float
    """Achieved FLOP/s of the linear layers."""
    mem_bandwidth: float
    """Achieved bytes/s."""
    attention_s_per_flop: float
    """Seconds per attention FLOP (1 / achieved attention FLOP/s; 0: no attention term)."""
    source: str = "roofline"
    """"roofline" (datasheet or measured peaks, no overhead) or "calibrated:<where>"."""
    gap_s: float = 0.0
    """Time between one step's end and the next one's start while requests run (the step's
    outputs handed on, the next one scheduled): what a request's cadence pays beyond the steps.
    Calibration measures it; the roofline has none."""

    @classmethod
    def roofline(cls, peak_flops: float, peak_bandwidth: float) -> StepModel:
        return cls(0.0, 0.0, peak_flops, peak_bandwidth, 1.0 / peak_flops, "roofline")

    def cost_seconds(self, cost: StepCost) -> float:
        if cost.sequences == 0:
            return 0.0
        return (
            self.overhead_s
            + self.per_sequence_s * cost.sequences
            + max(cost.linear_flops / self.flops, cost.bytes / self.mem_bandwidth)
            + cost.attention_flops * self.attention_s_per_flop
        )

    def period_seconds(self, cost: StepCost) -> float:
        """A step's time and the gap before the next one: its share of a request's cadence."""
        return self.cost_seconds(cost) + self.gap_s if cost.sequences else 0.0

    def seconds(
        self,
        m: ModelSpec,
        prompt_tokens: int,
        prompt_sequences: int,
        decode_tokens: int,
        decode_sequences: int,
        context_tokens: int,
    ) -> float:
        cost = step_cost(
            m, prompt_tokens, prompt_sequences, decode_tokens, decode_sequences, context_tokens
        )
        return self.cost_seconds(cost)

    def prefill_seconds(self, m: ModelSpec, prompt: int, chunk: int) -> float:
        """One prompt alone on an engine that computes `chunk` tokens per step: the sum of its
        chunks' periods, each chunk attending to the chunks before it."""
        total, done = 0.0, 0
        while done < prompt:
            size = min(chunk, prompt - done)
            # a chunk attends to the `done` tokens before it and causally to itself
            cost = step_cost(m, size, 1, 0, 0, 0)
            earlier = 4.0 * m.num_heads * m.head_dim * m.num_layers * size * done
            kv = kv_bytes_per_token(m) * done
            cost = StepCost(
                cost.linear_flops, cost.attention_flops + earlier, cost.bytes + kv, cost.sequences
            )
            total += self.period_seconds(cost)
            done += size
        return total

    def decode_step_seconds(self, m: ModelSpec, batch: int, context: int) -> float:
        """One decode step's period (`period_seconds`) for `batch` sequences holding `context`
        tokens each: the time between a sequence's tokens."""
        cost = step_cost(m, 0, 0, batch, batch, batch * context)
        return self.period_seconds(cost)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> StepModel:
        return cls(
            float(data["overhead_s"]),
            float(data["per_sequence_s"]),
            float(data["flops"]),
            float(data["mem_bandwidth"]),
            float(data["attention_s_per_flop"]),
            str(data.get("source", "calibrated")),
            float(data.get("gap_s", 0.0)),  # calibrations from before gaps were measured: none
        )


# -- where calibrations live -------------------------------------------------------------------


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_key(gpu_name: str | None = None, threads: int | None = None) -> str:
    """The name a calibration is stored under: the GPU's (one device per engine), or the CPU's
    model with the engine's thread count (a 1-core and a 2-core engine are different devices)."""
    if gpu_name:
        return _slug(gpu_name)
    threads = threads or int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    return f"cpu-{_slug(cpu_name())}-{threads}t"


def model_key(model: str, dtype: str) -> str:
    """A model folder (or hub name) and its dtype: `SmolLM2-135M-Instruct-bfloat16`."""
    return f"{str(model).rstrip('/').rsplit('/', 1)[-1]}-{dtype}"


CALIBRATION_ENV = "PDSERVE_CALIBRATION_DIR"


def calibration_dir(cache: str | Path | None = None) -> Path:
    """$PDSERVE_CALIBRATION_DIR, else <cache>/calibration (the model cache's folder)."""
    from pdserve_core.model_prep import cache_dir

    if os.environ.get(CALIBRATION_ENV):
        return Path(os.environ[CALIBRATION_ENV]).expanduser()
    return cache_dir(cache) / "calibration"


def calibration_path(device: str, model: str, base: str | Path | None = None) -> Path:
    """<base or calibration_dir()>/<device>/<model>.json (names as slugs)."""
    root = Path(base) if base else calibration_dir()
    return root / _slug(device) / f"{_slug(model)}.json"


class FitError(ValueError):
    """A calibration that cannot be made (too few or too uniform step records) or read."""


@dataclass(frozen=True)
class Calibration:
    device: str
    model: ModelSpec
    step_model: StepModel
    engine: dict
    """The engine settings it was measured with (max_num_batched_tokens, max_num_seqs, ...)."""
    fit: dict
    path: Path | None = None
    roles: dict[str, StepModel] | None = None
    """Per-role step models, where the calibration had enough steps of that role."""

    def for_role(self, role: str | None) -> StepModel:
        """The role's own step model if there is one, else the shared one."""
        return (self.roles or {}).get(role or "", self.step_model)


def load_calibration(path: str | Path) -> Calibration:
    path = Path(path).expanduser()
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise FitError(f"cannot read calibration {path}: {error}") from None
    if data.get("version") != CALIBRATION_VERSION:
        raise FitError(f"{path}: calibration version {data.get('version')!r} is not supported")
    try:
        model = ModelSpec(**data["model"])
        step = StepModel.from_dict({**data["step_model"], "source": f"calibrated:{path}"})
        roles = {
            role: StepModel.from_dict(
                {**entry["step_model"], "source": f"calibrated:{path}#{role}"}
            )
            for role, entry in (data.get("roles") or {}).items()
        }
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise FitError(f"{path}: malformed calibration ({error})") from None
    return Calibration(
        data.get("device", "?"),
        model,
        step,
        data.get("engine", {}),
        data.get("fit", {}),
        path,
        roles,
    )


def find_step_model(device: str, model: str, role: str | None = None) -> StepModel | None:
    """The stored calibration's step model for this device, model and role, if there is one."""
    path = calibration_path(device, model)
    if not path.is_file():
        return None
    try:
        return load_calibration(path).for_role(role)
    except FitError as error:
        import logging

        logging.getLogger(__name__).warning("ignoring calibration: %s", error)
        return None
