"""The roofline model: the one copy of the formulas pdserve uses (docs/design.md, "Why split
prefill from decode").

A linear layer W (d_in × d_out) applied to T tokens costs 2·T·d_in·d_out FLOPs and loads
dtype_bytes·d_in·d_out bytes of weights, so its arithmetic intensity (weights only) is
2·T / dtype_bytes — T for fp16/bf16. Attainable FLOP/s = min(peak, bandwidth · AI); the ridge
point peak / bandwidth separates memory-bound (below) from compute-bound (above). Prefill runs
T = B·S tokens, decode T = B. Times are pure roofline: max(FLOPs / peak, bytes / bandwidth) per
operation, summed — a lower bound that real kernels approach but do not reach.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve_core.roofline.specs import DeviceSpec, ModelSpec


@dataclass(frozen=True)
class Op:
    """One operation of one transformer block (or the LM head) in one phase."""

    name: str
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    def seconds(self, device: DeviceSpec) -> float:
        return max(self.flops / device.peak_flops, self.bytes / device.mem_bandwidth)


def linear_shapes(m: ModelSpec) -> list[tuple[str, int, int]]:
    """(name, d_in, d_out) of each linear layer in one block (Llama-style gated MLP)."""
    q_dim, kv_dim = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    return [
        ("q_proj", m.hidden_size, q_dim),
        ("k_proj", m.hidden_size, kv_dim),
        ("v_proj", m.hidden_size, kv_dim),
        ("o_proj", q_dim, m.hidden_size),
        ("gate_proj", m.hidden_size, m.intermediate_size),
        ("up_proj", m.hidden_size, m.intermediate_size),
        ("down_proj", m.intermediate_size, m.hidden_size),
    ]


def linear_ops(m: ModelSpec, tokens: int) -> list[Op]:
    """Linear layers of one block on `tokens` tokens; bytes are the weights (activations are
    small next to them and left out)."""
    return [
        Op(name, 2.0 * tokens * d_in * d_out, float(m.dtype_bytes * d_in * d_out))
        for name, d_in, d_out in linear_shapes(m)
    ]


def linear_intensity(m: ModelSpec, tokens: int) -> float:
    return 2.0 * tokens / m.dtype_bytes


def ridge_point(device: DeviceSpec) -> float:
    """FLOPs per byte where the roofline turns from bandwidth to compute."""
    return device.peak_flops / device.mem_bandwidth


def compute_bound_tokens(m: ModelSpec, device: DeviceSpec) -> int:
    """Fewest tokens per step at which the linear layers are compute-bound."""
    return math.ceil(ridge_point(device) * m.dtype_bytes / 2.0)


def recommended_chunk(m: ModelSpec, device: DeviceSpec) -> int:
    """Chunked-prefill size: the smallest power of two at or above the compute-bound threshold."""
    return 1 << max(0, math.ceil(math.log2(compute_bound_tokens(m, device))))


def kv_bytes_per_token(m: ModelSpec) -> int:
    """K and V for every layer: 2 · kv_heads · head_dim · layers · dtype_bytes."""
    return 2 * m.num_kv_heads * m.head_dim * m.num_layers * m.dtype_bytes


def parameter_count(m: ModelSpec) -> int:
    block = sum(d_in * d_out for _, d_in, d_out in linear_shapes(m)) + 2 * m.hidden_size
    embeddings = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    return m.num_layers * block + embeddings + m.hidden_size


def weight_bytes(m: ModelSpec) -> int:
    return parameter_count(m) * m.dtype_bytes


def kv_capacity_bytes(m: ModelSpec, device: DeviceSpec, memory_utilization: float = 0.9) -> float:
    """Device memory left for the KV cache: the usable share minus the weights (may be < 0)."""
    return device.mem_capacity * memory_utilization - weight_bytes(m)


def max_batch(
    m: ModelSpec, device: DeviceSpec, context: int, memory_utilization: float = 0.9
) -> int:
    """Most sequences of `context` tokens whose KV cache fits next to the weights."""
    room = kv_capacity_bytes(m, device, memory_utilization)
    return max(0, math.floor(room / (context * kv_bytes_per_token(m))))


def attention_prefill(m: ModelSpec, batch: int, prompt: int) -> Op:
    """Causal attention over the prompt, all layers' worth for one block: QKᵀ and AV cost
    2·2·S·(S/2)·heads·head_dim per sequence; bytes are Q, K, V and the output."""
    flops = 2.0 * batch * prompt * prompt * m.num_heads * m.head_dim
    width = 2 * m.num_heads * m.head_dim + 2 * m.num_kv_heads * m.head_dim
    return Op("attention", flops, float(batch * prompt * width * m.dtype_bytes))


def attention_decode(m: ModelSpec, batch: int, context: int) -> Op:
    """One new token per sequence attends to `context` cached tokens: reads that KV cache."""
    flops = 4.0 * batch * context * m.num_heads * m.head_dim
    kv = batch * context * 2 * m.num_kv_heads * m.head_dim * m.dtype_bytes
    return Op("attention", flops, float(kv))


def lm_head(m: ModelSpec, batch: int) -> Op:
    """Logits for the last position of each sequence (prefill and decode alike)."""
    return Op(
        "lm_head",
        2.0 * batch * m.hidden_size * m.vocab_size,
        float(m.dtype_bytes * m.hidden_size * m.vocab_size),
    )


def prefill_seconds(m: ModelSpec, device: DeviceSpec, batch: int, prompt: int) -> float:
    per_block = linear_ops(m, batch * prompt) + [attention_prefill(m, batch, prompt)]
    return m.num_layers * sum(op.seconds(device) for op in per_block) + lm_head(m, batch).seconds(
        device
    )


def decode_step_seconds(m: ModelSpec, device: DeviceSpec, batch: int, context: int) -> float:
    per_block = linear_ops(m, batch) + [attention_decode(m, batch, context)]
    return m.num_layers * sum(op.seconds(device) for op in per_block) + lm_head(m, batch).seconds(
        device
    )


def kv_transfer_seconds(m: ModelSpec, device: DeviceSpec, prompt: int) -> float:
    return prompt * kv_bytes_per_token(m) / device.interconnect_bandwidth


@dataclass(frozen=True)
class PoolPlan:
    prefill_requests_per_s: float
    """What one prefill device sustains (compute-bound, requests prefilled back to back)."""
    decode_batch: int
    """Decode batch per device: the largest that fits in memory and meets the TPOT SLO."""
    decode_requests_per_s: float
    prefill_devices: int
    decode_devices: int


def plan_pools(
    m: ModelSpec,
    device: DeviceSpec,
    prompt: int,
    output: int,
    rate: float,
    tpot_slo: float | None,
    memory_utilization: float = 0.9,
    prefill_s=None,
    decode_s=None,
) -> PoolPlan:
    """Devices per pool for `rate` requests/s of `prompt` in, `output` out. `prefill_s(prompt)`
    and `decode_s(batch, context)` price the steps (default: the roofline on `device`; the
    calibrated step model when given)."""
    prefill_s = prefill_s or (lambda length: prefill_seconds(m, device, 1, length))
    decode_s = decode_s or (lambda batch, context: decode_step_seconds(m, device, batch, context))
    prefill_rps = 1.0 / prefill_s(prompt)
    context = prompt + output
    batch = max_batch(m, device, context, memory_utilization)
    mid_context = prompt + output // 2
    if tpot_slo is not None:
        while batch > 1 and decode_s(batch, mid_context) > tpot_slo:
            batch = math.floor(batch * 0.9) if batch > 10 else batch - 1
    decode_rps = 0.0
    if batch > 0:
        decode_rps = batch / (decode_s(batch, mid_context) * output)
    prefill_devices = max(1, math.ceil(rate / prefill_rps))
    decode_devices = max(1, math.ceil(rate / decode_rps)) if decode_rps else 0
    return PoolPlan(prefill_rps, batch, decode_rps, prefill_devices, decode_devices)
