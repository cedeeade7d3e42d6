"""Planner formulas against values worked out by hand (docs/design.md)."""

from __future__ import annotations

import json
import math

import pytest

from pdserve.planner.plan import Workload, build_plan, format_plan
from pdserve_core.roofline import model as rf
from pdserve_core.roofline.specs import (
    DEVICES,
    PRESETS,
    SpecError,
    load_device,
    load_model,
    model_from_hf_config,
)

LLAMA3_8B = PRESETS["llama-3-8b"]  # grouped-query attention: 32 query heads, 8 KV heads
LLAMA2_7B = model_from_hf_config(  # multi-head attention: as many KV heads as query heads
    {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
        "torch_dtype": "float16",
    },
    name="llama-2-7b",
)
A100, H100, H200 = DEVICES["a100-sxm-80gb"], DEVICES["h100-sxm"], DEVICES["h200"]


def test_parameter_counts_match_the_published_sizes():
    # block: q,o 4096² each + k,v 4096·1024 each + 3 MLP 4096·14336, plus two norms
    block = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert rf.parameter_count(LLAMA3_8B) == 32 * block + 2 * 128256 * 4096 + 4096 == 8_030_261_248
    assert rf.parameter_count(LLAMA2_7B) == 6_738_415_616
    assert rf.weight_bytes(LLAMA3_8B) == 2 * 8_030_261_248


def test_kv_bytes_per_token_gqa_and_mha():
    assert rf.kv_bytes_per_token(LLAMA3_8B) == 2 * 8 * 128 * 32 * 2 == 131_072  # 128 KiB
    assert rf.kv_bytes_per_token(LLAMA2_7B) == 2 * 32 * 128 * 32 * 2 == 524_288  # 512 KiB
    assert rf.kv_bytes_per_token(PRESETS["smollm2-135m"]) == 30 * 768  # docs/design.md


@pytest.mark.parametrize(
    ("device", "ridge", "threshold", "chunk"),
    [(A100, 312 / 2.039, 154, 256), (H100, 989 / 3.35, 296, 512), (H200, 989 / 4.8, 207, 256)],
)
def test_ridge_threshold_and_chunk_on_three_gpus(device, ridge, threshold, chunk):
    assert rf.ridge_point(device) == pytest.approx(ridge)
    for model in (LLAMA3_8B, LLAMA2_7B):  # both 2-byte dtypes: AI = tokens
        assert rf.compute_bound_tokens(model, device) == threshold
        assert rf.recommended_chunk(model, device) == chunk
        assert rf.linear_intensity(model, chunk) >= rf.ridge_point(device)
        assert rf.linear_intensity(model, chunk // 2) < rf.ridge_point(device)


def test_linear_layer_flops_bytes_and_intensity():
    ops = {op.name: op for op in rf.linear_ops(LLAMA3_8B, 512)}
    assert ops["q_proj"].flops == 2 * 512 * 4096 * 4096
    assert ops["k_proj"].bytes == 2 * 4096 * 1024
    assert ops["down_proj"].flops == 2 * 512 * 14336 * 4096
    assert all(op.intensity == 512 for op in ops.values())
    fp32 = model_from_hf_config({**_minimal(), "torch_dtype": "float32"})
    assert rf.linear_ops(fp32, 512)[0].intensity == 256  # AI = 2T / dtype_bytes


def test_decode_step_time_by_hand_h100():
    per_block_weights = 2 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    attention_kv = 1 * 1 * 2 * 8 * 128 * 2
    head = 2 * 4096 * 128256
    expected = (32 * (per_block_weights + attention_kv) + head) / 3.35e12
    assert rf.decode_step_seconds(LLAMA3_8B, H100, batch=1, context=1) == pytest.approx(expected)


def test_prefill_time_by_hand_h100():
    linear = 2 * 1024 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    attention = 2 * 1024 * 1024 * 32 * 128  # causal QKᵀ + AV, AI 409.6: compute-bound
    head_bytes = 2 * 4096 * 128256  # one logits row: memory-bound
    expected = 32 * (linear + attention) / 989e12 + head_bytes / 3.35e12
    assert rf.prefill_seconds(LLAMA3_8B, H100, batch=1, prompt=1024) == pytest.approx(expected)


def test_short_prompt_prefill_is_memory_bound():
    plan = build_plan(LLAMA3_8B, H100, Workload(batch=1, prompt_len=32, output_len=8))
    prefill = [row for row in plan["layers"] if row["phase"] == "prefill"]
    assert {row["bound"] for row in prefill} == {"memory"}
    long = build_plan(LLAMA3_8B, H100, Workload(batch=4, prompt_len=1024))
    assert {r["bound"] for r in long["layers"] if r["phase"] == "prefill"} == {"compute"}
    assert {r["bound"] for r in long["layers"] if r["phase"] == "decode"} == {"memory"}


def test_memory_fit_and_largest_batch_a100():
    free = 80e9 * 0.9 - 2 * 8_030_261_248
    assert rf.kv_capacity_bytes(LLAMA3_8B, A100) == pytest.approx(free)
    assert rf.max_batch(LLAMA3_8B, A100, 1280) == math.floor(free / (1280 * 131_072)) == 333
    plan = build_plan(LLAMA3_8B, A100, Workload(batch=400, prompt_len=1024, output_len=256))
    assert plan["memory"]["fits"] is False and plan["memory"]["max_batch"] == 333
    assert any("does not fit" in reason for reason in plan["reasoning"])


def test_weights_larger_than_the_device():
    seventy = PRESETS["llama-3-70b"]
    assert rf.kv_capacity_bytes(seventy, A100) < 0
    assert rf.max_batch(seventy, A100, 1024) == 0
    plan = build_plan(seventy, A100, Workload())
    assert plan["memory"]["fits"] is False and plan["pools"]["decode_devices"] == 0


def test_config_missing_optional_fields_falls_back():
    spec = model_from_hf_config(_minimal())
    assert spec.num_kv_heads == spec.num_heads == 16  # no num_key_value_heads: MHA
    assert spec.head_dim == 2048 // 16  # no head_dim: hidden / heads
    assert spec.tie_word_embeddings is False and spec.dtype_bytes == 2  # bf16 default
    with pytest.raises(SpecError, match="lacks 'vocab_size'"):
        model_from_hf_config({k: v for k, v in _minimal().items() if k != "vocab_size"})


def test_real_config_json_of_the_default_model(default_model_dir):
    spec = load_model(str(default_model_dir))
    preset = PRESETS["smollm2-135m"]
    assert (spec.hidden_size, spec.num_layers, spec.num_kv_heads, spec.head_dim) == (
        preset.hidden_size,
        preset.num_layers,
        preset.num_kv_heads,
        preset.head_dim,
    )
    assert spec.tie_word_embeddings


def test_tpot_slo_shrinks_the_decode_batch_and_pools_scale_with_rate():
    free_run = rf.plan_pools(LLAMA3_8B, H100, 1024, 256, rate=10, tpot_slo=None)
    slo = 0.02
    bound = rf.plan_pools(LLAMA3_8B, H100, 1024, 256, rate=10, tpot_slo=slo)
    assert bound.decode_batch < free_run.decode_batch
    assert rf.decode_step_seconds(LLAMA3_8B, H100, bound.decode_batch, 1024 + 128) <= slo
    more = rf.plan_pools(LLAMA3_8B, H100, 1024, 256, rate=100, tpot_slo=slo)
    assert more.prefill_devices >= bound.prefill_devices
    assert more.decode_devices > bound.decode_devices
    assert more.prefill_devices == math.ceil(100 / more.prefill_requests_per_s)


def test_devices_from_flags_and_file(tmp_path):
    with pytest.raises(SpecError, match="--peak-tflops"):
        load_device("cpu")
    cpu = load_device("cpu", None, 2.0, 100, 24, 1.7)
    assert rf.ridge_point(cpu) == pytest.approx(20)
    faster = load_device("h100-sxm", bandwidth_gbs=4000)
    assert faster.mem_bandwidth == 4e12 and faster.peak_flops == H100.peak_flops
    devices = tmp_path / "devices.yaml"
    devices.write_text("mi300x: {peak_tflops: 1307, bandwidth_gbs: 5300, memory_gb: 192}\n")
    assert load_device("mi300x", str(devices)).mem_capacity == 192e9
    with pytest.raises(SpecError, match="unknown device 'tpu'"):
        load_device("tpu")


def test_plan_human_output_reads(capsys):
    text = format_plan(build_plan(LLAMA3_8B, H100, Workload(batch=8)))
    assert "ridge point             295.2 FLOP/B" in text
    assert "recommended chunk       512 tokens" in text
    assert "why:" in text


JSON_KEYS = {
    "calibration",
    "model",
    "device",
    "workload",
    "ridge_point",
    "layers",
    "decode_compute_bound_batch",
    "memory",
    "chunk",
    "estimates",
    "pools",
    "reasoning",
}


def test_cli_json_has_the_documented_keys_and_plot_writes_a_png(tmp_path, capsys):
    from pdserve.cli import main

    png = tmp_path / "roofline.png"
    args = ["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--batch", "8", "--json"]
    assert main([*args, "--plot", str(png)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert set(plan) == JSON_KEYS
    assert set(plan["estimates"]) == {
        "ttft_s",
        "tpot_s",
        "kv_transfer_s",
        "source",
        "decode_batch_at_rate",
        "tpot_at_rate_s",
    }
    assert plan["estimates"]["source"] == "roofline" and plan["calibration"] is None
    assert set(plan["pools"]) >= {"prefill_devices", "decode_devices", "ratio", "decode_batch"}
    assert len(plan["layers"]) == 14
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 20_000 < png.stat().st_size < 2_000_000


def test_cli_rejects_bad_input(capsys):
    from pdserve.cli import main

    assert main(["plan", "--model", "gpt-17"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert main(["plan", "--batch", "0"]) == 2
    assert "batch must be at least 1" in capsys.readouterr().err


def test_serve_takes_its_chunk_from_the_planner(default_model_dir, monkeypatch):
    from pdserve.serve import with_planned_chunk
    from pdserve_core.config import parse_config
    from pdserve_core.roofline import serving

    planned = with_planned_chunk(
        parse_config({"engine": {"device": "h100-sxm"}}), default_model_dir
    )
    assert planned.engine.max_num_batched_tokens == 512
    chosen = parse_config({"engine": {"device": "h100-sxm", "max_num_batched_tokens": 2048}})
    assert with_planned_chunk(chosen, default_model_dir).engine.max_num_batched_tokens == 2048
    monkeypatch.setattr(serving, "detect_device", lambda: None)  # a CPU machine
    cpu = with_planned_chunk(parse_config({}), default_model_dir)  # no device: each engine's
    assert cpu.engine.max_num_batched_tokens is None  # own host decides (a CPU: below)


def test_a_cpu_engine_with_streams_steps_256_prompt_tokens_unless_told():
    from pdserve_core.roofline.serving import CPU_CHUNK_TOKENS, cpu_chunk_size

    for role in ("colocated", "decode"):
        assert cpu_chunk_size(None, 64, role) == CPU_CHUNK_TOKENS == 256
        assert cpu_chunk_size(2048, 64, role) == 2048  # the config's own
        assert cpu_chunk_size(None, 512, role) == 512  # vLLM: a step's budget holds every sequence
    assert cpu_chunk_size(None, 64, "prefill") is None  # vLLM's own default
    assert cpu_chunk_size(128, 64, "prefill") == 128


def test_a_cpu_engine_keeps_32_token_kv_blocks_unless_told():
    from pdserve_core.roofline.serving import CPU_BLOCK_TOKENS, cpu_block_size

    assert cpu_block_size(None) == CPU_BLOCK_TOKENS == 32
    assert cpu_block_size(128) == 128  # the config's own


def _minimal() -> dict:
    return {
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "intermediate_size": 5632,
        "vocab_size": 32000,
    }
