"""`pdserve model prepare` for real: the default model built from its GGUF file (~20-40 s)."""

from __future__ import annotations

import time

from pdserve_core.model_prep import check_model_dir, prepare_default_model


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
