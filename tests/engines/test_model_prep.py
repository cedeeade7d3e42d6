"""`pdserve model prepare` for real: a prepared folder found at once, and the default model built
from its GGUF file (~20-40 s) in place of a broken one. The build into an empty cache is the
one `.ci/run` and `scripts/bootstrap.sh` make before any test (`default_model_dir`)."""

from __future__ import annotations

import shutil
import time

from pdserve_core import model_prep


def test_a_prepared_model_returns_at_once_and_a_broken_one_is_built_again(
    default_model_dir, tmp_path
):
    """The session's prepared model, copied into an empty cache: found without a build; then,
    its tokenizer gone, a real build from the GGUF in its place, and nothing else left."""
    from transformers import AutoConfig, AutoTokenizer

    path = model_prep.default_model_dir(tmp_path)
    shutil.copytree(default_model_dir, path)
    built = (path / "model.safetensors").stat().st_mtime_ns
    started = time.monotonic()
    assert model_prep.prepare_default_model(tmp_path) == path
    assert time.monotonic() - started < 5
    assert (path / "model.safetensors").stat().st_mtime_ns == built

    (path / "tokenizer.json").unlink()
    assert model_prep.prepare_default_model(tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns != built
    assert model_prep.check_model_dir(path) == []
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
