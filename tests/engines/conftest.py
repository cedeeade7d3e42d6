from __future__ import annotations

import os

import pytest

from pdserve_core.roofline.specs import load_model


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """One local Ray for every KV engine test (engines come and go per module)."""
    import ray

    os.environ.setdefault("VLLM_RPC_BASE_PATH", str(tmp_path_factory.mktemp("vllm-rpc")))
    ray.init(
        address="local",  # a Ray of its own, whatever cluster this machine last started
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"VLLM_RPC_BASE_PATH": os.environ["VLLM_RPC_BASE_PATH"]}},
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def corpus(tokenizer) -> list[int]:
    """Real text from this repository, tokenized: prompts are slices of it."""
    from tests.conftest import REPO

    text = "\n\n".join(
        (REPO / name).read_text()
        for name in ("docs/design.md", "pdserve_core/config.py", "router/faces/vllm_face.py")
    )
    ids = tokenizer(text).input_ids
    assert len(ids) > 2600
    return ids


@pytest.fixture(scope="session")
def kv_bytes_per_token(default_model_dir) -> int:
    """KV bytes per token of the test engines (float32, see harness.py)."""
    from pdserve_core.roofline.model import kv_bytes_per_token

    return kv_bytes_per_token(load_model(str(default_model_dir), "float32"))
