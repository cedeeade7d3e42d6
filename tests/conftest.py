from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded default model, prepared once (bootstrap already built it; this only checks)."""
    from pdserve.model_prep import prepare_default_model

    return prepare_default_model()
