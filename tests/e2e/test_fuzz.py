"""The fuzzing tier: requests drawn from the API's own schemas, and the hostile list, against a
real `pdserve serve` (default 1P1D: real Ray, two vLLM engines, KV over TCP). Nothing may answer
5xx, hang, take an engine down, or leave KV blocks held (tests/helpers/fuzz.py says what is sent
and checked). `benchmarks/fuzz.py` runs the same with more requests and records the figures."""

from __future__ import annotations

import os

import pytest

from tests.e2e.conftest import finish_server, start_server
from tests.helpers import fuzz

API_KEY = "fuzz-key"
REQUESTS = int(os.environ.get("PDSERVE_FUZZ_REQUESTS", "300"))


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("serve-fuzz")
    config = work / "pdserve.yaml"
    config.write_text(f"router: {{api_key: {API_KEY}}}\n")
    server = start_server(work, "--config", str(config), api_key=API_KEY)
    yield server
    finish_server(server)


def test_drawn_and_hostile_requests_get_no_5xx_kill_nothing_and_leave_nothing_held(server):
    report = fuzz.run(server.url, server.headers, server.model, REQUESTS, seed=REQUESTS)
    summary = report.summary()
    print("fuzz:", summary)
    assert summary["requests"] == REQUESTS + len(fuzz.HOSTILE)
    assert report.problems() == []
    # the run reached the engines, not only the validation
    assert summary["statuses"].get("200", 0) > REQUESTS // 3
