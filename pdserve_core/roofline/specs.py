"""What the roofline model needs to know: a model's shapes and a device's peaks.

`ModelSpec` comes from a Hugging Face `config.json` (Llama, Qwen2, Mistral, SmolLM style) or a
built-in preset; `DeviceSpec` from the catalog below, a YAML file, or figures given on the command
line (the `cpu` entry has none built in: its figures depend on the machine).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}


class SpecError(ValueError):
    """A model config or device description that cannot be used."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    dtype_bytes: int = 2


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops: float
    """Dense fp16/bf16 tensor FLOP/s."""
    mem_bandwidth: float
    """HBM (or DRAM) bytes/s."""
    mem_capacity: float
    """Bytes of device memory."""
    interconnect_bandwidth: float
    """Bytes/s between a prefill and a decode device (NVLink, PCIe or network)."""


GB = 1e9
TB = 1e12
GIB = 2**30

# Datasheet figures: dense (no sparsity) bf16 tensor throughput, memory bandwidth and capacity,
# and the link a KV transfer would use between two such devices.
DEVICES: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        DeviceSpec("a100-sxm-80gb", 312 * TB, 2.039 * TB, 80 * GB, 600 * GB),
        DeviceSpec("h100-sxm", 989 * TB, 3.35 * TB, 80 * GB, 900 * GB),
        DeviceSpec("h100-pcie", 756 * TB, 2.0 * TB, 80 * GB, 64 * GB),
        DeviceSpec("h200", 989 * TB, 4.8 * TB, 141 * GB, 900 * GB),
        DeviceSpec("l40s", 362 * TB, 0.864 * TB, 48 * GB, 32 * GB),
        DeviceSpec("b200", 2250 * TB, 8.0 * TB, 180 * GB, 1800 * GB),
    )
}
USER_DEVICE = "cpu"
"""Catalog name with no built-in figures: pass them with flags or a YAML file."""

PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("llama-3-8b", 4096, 32, 32, 8, 128, 14336, 128256),
        ModelSpec("llama-3-70b", 8192, 80, 64, 8, 128, 28672, 128256),
        ModelSpec("qwen2.5-7b", 3584, 28, 28, 4, 128, 18944, 152064),
        ModelSpec("smollm2-135m", 576, 30, 9, 3, 64, 1536, 49152, tie_word_embeddings=True),
    )
}


def model_from_hf_config(config: dict, name: str = "model", dtype: str | None = None) -> ModelSpec:
    """Read the shapes the roofline needs; optional fields fall back the way transformers does."""
    try:
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        intermediate = int(config["intermediate_size"])
        vocab = int(config["vocab_size"])
    except KeyError as missing:
        raise SpecError(f"model config {name!r} lacks {missing.args[0]!r}") from None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    dtype = dtype or config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    if dtype not in DTYPE_BYTES:
        raise SpecError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
    return ModelSpec(
        name=name,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=vocab,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        dtype_bytes=DTYPE_BYTES[dtype],
    )


def load_model(ref: str, dtype: str | None = None) -> ModelSpec:
    """A preset name, a model folder holding config.json, or a config.json path."""
    if ref in PRESETS:
        spec = PRESETS[ref]
        return replace(spec, dtype_bytes=DTYPE_BYTES[dtype]) if dtype else spec
    path = Path(ref).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise SpecError(
            f"{ref!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json / model folder"
        )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise SpecError(f"{path} is not valid JSON: {error}") from None
    return model_from_hf_config(config, name=path.parent.name, dtype=dtype)


def load_device(
    name: str,
    devices_file: str | None = None,
    peak_tflops: float | None = None,
    bandwidth_gbs: float | None = None,
    memory_gb: float | None = None,
    interconnect_gbs: float | None = None,
) -> DeviceSpec:
    """A catalog device, optionally overridden field by field; `cpu` or unknown names need all
    figures from flags or from a YAML file mapping names to
    {peak_tflops, bandwidth_gbs, memory_gb, interconnect_gbs}."""
    catalog = dict(DEVICES)
    if devices_file:
        catalog.update(_read_devices_file(devices_file))
    base = catalog.get(name)
    if base is None and name != USER_DEVICE:
        known = ", ".join([*catalog, USER_DEVICE])
        raise SpecError(f"unknown device {name!r}; known: {known} (or add it with --devices-file)")
    figures = {
        "peak_flops": peak_tflops * TB if peak_tflops else None,
        "mem_bandwidth": bandwidth_gbs * GB if bandwidth_gbs else None,
        "mem_capacity": memory_gb * GB if memory_gb else None,
        "interconnect_bandwidth": interconnect_gbs * GB if interconnect_gbs else None,
    }
    if base is None:
        missing = [flag for flag, value in zip(_FLAGS, figures.values(), strict=True) if not value]
        if missing:
            raise SpecError(f"device {name!r} has no built-in figures; give {', '.join(missing)}")
        return DeviceSpec(name, **figures)
    return replace(base, **{k: v for k, v in figures.items() if v})


_FLAGS = ("--peak-tflops", "--bandwidth-gbs", "--memory-gb", "--interconnect-gbs")


def _read_devices_file(path: str) -> dict[str, DeviceSpec]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        raise SpecError(f"cannot read devices file {path}: {error}") from None
    devices = {}
    for name, entry in data.items():
        try:
            devices[name] = DeviceSpec(
                name,
                float(entry["peak_tflops"]) * TB,
                float(entry["bandwidth_gbs"]) * GB,
                float(entry["memory_gb"]) * GB,
                float(entry.get("interconnect_gbs", 25)) * GB,
            )
        except (KeyError, TypeError, ValueError) as error:
            raise SpecError(f"device {name!r} in {path}: bad or missing field {error}") from None
    return devices
