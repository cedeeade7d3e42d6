"""The default configuration (1P1D, bf16) end to end, on one running server:

- metrics: a real Prometheus (Debian's package, 1 s scrapes, the repo's rule files) scrapes it
  under load; every expression of the recording rules, the alert rules and the Grafana dashboard
  must return data, per pool with both pools present;
- the bench drives it;
- the seam in bf16, where exact comparisons do not hold across CPUs: what must hold does
  (structured output parses and obeys its schema, a choice is one of the choices, a stop string
  spanning the first token stops the request and is absent, n sequences come back);
- last, the fuzzing tier: requests drawn from the API's own schemas and the hostile list
  (tests/helpers/fuzz.py): no 5xx, no engine replaced, nothing held afterwards.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml

from pdserve_core.engine.dtype import native_dtype
from tests.conftest import REPO
from tests.e2e.conftest import finish_server, samples, start_server

RULES = sorted((REPO / "deploy/prometheus/rules").glob("*.yml"))
DASHBOARD = REPO / "deploy/grafana/dashboards/pdserve-pool-balance.json"
POOLS = {"prefill", "decode"}
DATA_DEADLINE_S = 120


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("serve-metrics"))
    yield server
    finish_server(server)


# ---- the seam in bf16: validity (first, before the metrics tests load the server) --------------

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Name a city in Egypt."}]


def _ask(server, path: str, body: dict, stream: bool) -> tuple[str, str | None, int]:
    """(text, finish reason, sequences) of one request, streamed or not."""
    body = {**body, "stream": stream}
    if not stream:
        answer = httpx.post(f"{server.url}{path}", json=body, timeout=300).json()
        choice = answer["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        return text, choice["finish_reason"], len(answer["choices"])
    text, finish, indexes = "", None, set()
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                indexes.add(choice["index"])
                if choice["index"] == 0:
                    text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    finish = choice.get("finish_reason") or finish
    return text, finish, len(indexes)


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_is_valid_in_bf16(server, stream):
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    text, finish, _ = _ask(
        server,
        "/v1/chat/completions",
        {"messages": ASK, "max_tokens": 60, "response_format": schema},
        stream,
    )
    value = json.loads(text)
    assert finish == "stop" and set(value) == {"city"} and len(value["city"]) <= 24
    choices = ["yes, it is", "no, it is not"]
    text, _, _ = _ask(
        server,
        "/v1/completions",
        {
            "prompt": "Is Cairo in Egypt?",
            "max_tokens": 10,
            "structured_outputs": {"choice": choices},
        },
        stream,
    )
    assert text in choices
    text, _, _ = _ask(
        server,
        "/v1/completions",
        {
            "prompt": "A word:",
            "max_tokens": 12,
            "structured_outputs": {"regex": r"[A-Z][a-z]{2,8}\."},
        },
        stream,
    )
    assert re.fullmatch(r"[A-Z][a-z]{2,8}\.", text), text


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_spanning_the_first_token_stops_in_bf16(server, stream):
    prompt = "The capital of France is"
    # a stop string that never matches places the free run as the stopped one will be placed
    # (the decode node samples every token), so both compute the same tokens in bf16
    free = httpx.post(
        f"{server.url}/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": 12,
            "temperature": 0,
            "logprobs": 0,
            "stop": ["<<never>>"],
        },
        timeout=300,
    ).json()["choices"][0]
    tokens = free["logprobs"]["tokens"]
    span = tokens[0][-min(2, len(tokens[0])) :] + tokens[1] + tokens[2][:1]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [span]}
    text, finish, _ = _ask(server, "/v1/completions", body, stream)
    assert finish == "stop" and span not in text
    assert free["text"].startswith(text)


def test_each_engine_runs_only_on_the_core_its_pool_names(server):
    """The default 1P1D pins the prefill engine to core 0 and the decode engine to core 1
    (`pools.*.cpu_bind`): every thread of each EngineCore, its model worker inside, may run only
    there, as vLLM pins a worker process of its own. Before, with the worker inside, nothing
    pinned them and both engines ran on either core."""
    import psutil

    cores = {}
    for process in psutil.Process(server.process.pid).children(recursive=True):
        if process.name().startswith("VLLM::EngineCor"):
            role = "prefill" if "Prefill" in " ".join(process.parent().cmdline()) else "decode"
            cores[role] = set()
            for thread in process.threads():
                try:
                    cores[role].add(frozenset(os.sched_getaffinity(thread.id)))
                except ProcessLookupError:  # a thread that ended meanwhile
                    pass
    assert cores == {"prefill": {frozenset({0})}, "decode": {frozenset({1})}}


def test_n_sequences_in_bf16(server):
    body = {"prompt": "Once upon a time", "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 7}
    for stream in (False, True):
        _, _, count = _ask(server, "/v1/completions", body, stream)
        assert count == 3


# ---- metrics -------------------------------------------------------------------------------


class Load:
    """Background clients (see `load`); `stop` ends them and waits for their last requests."""

    def __init__(self, server) -> None:
        self._stop = threading.Event()
        words = (REPO / "docs" / "design.md").read_text().split()

        def client(seed: int) -> None:
            with httpx.Client(base_url=server.url, timeout=120) as http:
                i = seed
                while not self._stop.is_set():
                    start, length = i * 37 % 2000, 20 + (i * 53) % 400 + 600 * (i % 6 == 0)
                    prompt = " ".join(words[start : start + length])
                    body = {"prompt": prompt, "max_tokens": 12, "stream": True, "ignore_eos": True}
                    with http.stream("POST", "/v1/completions", json=body) as response:
                        response.read()
                    i += 2

        self._threads = [
            threading.Thread(target=client, args=(seed,), daemon=True) for seed in (0, 1)
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)


@pytest.fixture(scope="module")
def load(server):
    """Streamed requests of mixed lengths (≈ 25 to 1400 tokens: short ones the adaptive
    placement keeps on the decode node, long ones it sends to the prefill node on any CPU) from
    two clients, for the metrics tests; the tests after them stop it first (the bench, the
    calibration and the fuzzing tier measure or judge the server alone: on two cores the load
    starved them), so the load does not outlive the tests that read it."""
    running = Load(server)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def prometheus(server, load, tmp_path_factory):
    """Prometheus on loopback scraping the router every second, with the repo's rule files."""
    assert shutil.which("prometheus"), "install Debian's prometheus package (.ci/run does)"
    work = tmp_path_factory.mktemp("prometheus")
    target = server.url.removeprefix("http://")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(path) for path in RULES],
        "scrape_configs": [{"job_name": "pdserve", "static_configs": [{"targets": [target]}]}],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    log = (work / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_data(url, process)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


class NotReady(Exception):
    """Prometheus is starting (it answers 503 "Service Unavailable" in plain text at first)."""


def query(url: str, expr: str) -> list[dict]:
    try:
        response = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    except httpx.HTTPError as error:
        raise NotReady(str(error)) from None
    if response.status_code == 503 or "json" not in response.headers.get("content-type", ""):
        raise NotReady(f"{response.status_code}: {response.text[:200]}")
    body = response.json()
    assert body.get("status") == "success", f"{expr}: {body}"
    return body["data"]["result"]


def _wait_for_data(url: str, process: subprocess.Popen) -> None:
    """Until the slowest series exist: a minute-window latency quantile over real requests,
    and KV transfers seen in two scrapes."""
    probes = (
        'up{job="pdserve"} == 1',
        "pdserve:time_to_first_token_seconds:p99_rate1m",
        "pdserve:kv_transfer_seconds:mean_rate1m",
        'pool:pdserve_compute_utilization:ratio_rate1m{pool="decode"}',
    )
    deadline = time.monotonic() + DATA_DEADLINE_S
    while time.monotonic() < deadline:
        assert process.poll() is None, "prometheus exited"
        try:
            if all(_has_number(query(url, probe)) for probe in probes):
                return
        except NotReady:
            pass
        time.sleep(1)
    raise TimeoutError(f"no data from Prometheus for {probes} in {DATA_DEADLINE_S} s")


def _has_number(result: list[dict]) -> bool:
    return any(sample["value"][1] not in ("NaN", "+Inf", "-Inf") for sample in result)


SERIES_DEADLINE_S = 20
"""How long an expression may take to return data: a scrape that fails or times out (the
router busy) marks every series stale until the next one, so an instant query can come back
empty for a second or two."""


def assert_data(url: str, expr: str, per_pool: bool, where: str, enough=bool) -> list[dict]:
    """`expr`'s result once it has data (for each pool with `per_pool`) that is `enough`,
    polled until `SERIES_DEADLINE_S`; the last result past it."""
    deadline = time.monotonic() + SERIES_DEADLINE_S
    while True:
        result, pools = [], set()
        try:
            result = query(url, expr)
        except NotReady:
            pass
        pools = {sample["metric"].get("pool") for sample in result}
        if result and (not per_pool or POOLS <= pools):
            if enough(result) or time.monotonic() > deadline:
                return result
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert result, f"{where}: no data for {expr}"
    raise AssertionError(f"{where}: {expr} has pools {pools}, wants {POOLS}")


def _rules(kind: str) -> list[dict]:
    return [
        rule
        for path in RULES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
        if kind in rule
    ]


def _operands(expr: str) -> list[str]:
    """The value expressions an alert compares with thresholds: `A > x and B > y` → [A, B]."""
    parts = re.split(r"\s+(?:and|or|unless)\s+", " ".join(expr.split()))
    return [re.split(r"\s+(?:>=|<=|==|!=|>|<)\s+", part)[0] for part in parts]


def test_recording_rules_return_data_for_both_pools(prometheus):
    rules = _rules("record")
    assert len(rules) >= 10
    for rule in rules:
        per_pool = rule["record"].startswith("pool:")
        assert_data(prometheus, rule["expr"], per_pool, rule["record"])
        recorded = assert_data(prometheus, rule["record"], per_pool, f"recorded {rule['record']}")
        if "utilization" in rule["record"]:
            values = {s["metric"]["pool"]: float(s["value"][1]) for s in recorded}
            assert all(0 <= value <= 1 for value in values.values()), (rule["record"], values)


def test_alert_rule_expressions_return_data(prometheus):
    rules = _rules("alert")
    assert {rule["alert"] for rule in rules} >= {
        "PdservePoolSaturated",
        "PdserveKVTransferFailures",
        "PdserveTTFTBudgetBurnFast",
    }
    for rule in rules:
        for operand in _operands(rule["expr"]):
            per_pool = operand.startswith(("pool:", "pdserve_pool_"))
            assert_data(prometheus, operand, per_pool, rule["alert"])


def test_every_dashboard_panel_returns_data(prometheus):
    panels = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    for panel in panels:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "1m")
            if panel["description"].startswith("GPU only"):
                assert query(prometheus, expr) == [], "NVML series on a machine without a GPU"
                continue
            per_pool = "{{pool}}" in target["legendFormat"]
            assert_data(prometheus, expr, per_pool, panel["title"])


def test_the_roofline_separates_the_pools(prometheus):
    """Prefill runs many tokens per weight read, decode one: the measured intensity says so."""
    rule = "pool:pdserve_arithmetic_intensity:flops_per_byte_rate1m"
    intensity = {
        sample["metric"]["pool"]: float(sample["value"][1])
        for sample in assert_data(prometheus, rule, True, "intensity")
    }
    assert intensity["prefill"] > 5 * intensity["decode"], intensity
    for expr in (
        'sum(pdserve_kv_transfer_bytes_total{direction="sent"})',
        'sum(pdserve_kv_transfer_bytes_total{direction="received"})',
        'pdserve_node_prompt_tokens_total{pool="decode",source="transferred"}',
    ):
        value = float(assert_data(prometheus, expr, False, "KV transfer")[0]["value"][1])
        assert value > 0, f"{expr} is {value}: no KV crossed from prefill to decode"


def _placements(server) -> dict[str, float]:
    return {
        f"{s.labels['where']}/{s.labels['reason']}": s.value
        for s in samples(server)
        if s.name == "pdserve_prefill_placements_total"
    }


def test_a_short_prompt_does_not_wait_behind_long_prefills(server, prometheus, load):
    """The adaptive default: long prompts queued on the prefill node, a short prompt arriving
    behind them is computed on its decode node (`prefill_backlog`); the long ones went to the
    prefill node. Each decision is counted, and Prometheus sees both kinds. A round sends six
    long prompts and, once the router is seen holding two of them for the prefill node, the
    short one. On a host with bf16 instructions a long prefill takes a fraction of a second and
    the adaptive rule itself sends some long prompts to the decode node, so a round can end
    before that backlog is seen: up to four rounds, each with prompts no earlier round cached."""
    load.stop()
    before = _placements(server)

    def send(prompt) -> int:
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
        return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).status_code

    def backlog_seen(longs) -> bool:
        deadline = time.monotonic() + 60
        while not all(f.done() for f in longs):  # the router's own count, prefill pool
            nodes = httpx.get(f"{server.url}/health", timeout=10).json()["pools"]["prefill"]
            if sum(n["prefilling_tokens"] for n in nodes["nodes"]) >= 3000:
                return True
            assert time.monotonic() < deadline, "the long prompts never reached the prefill node"
            time.sleep(0.01)
        return False

    rounds = []
    for round_ in range(4):
        start = _placements(server)
        long_prompts = [  # 1900 tokens each, first tokens unlike any earlier prompt's
            list(range(1000 + 50 * round_ + i, 2900 + 50 * round_ + i)) for i in range(6)
        ]
        with concurrent.futures.ThreadPoolExecutor(len(long_prompts)) as pool:
            longs = [pool.submit(send, prompt) for prompt in long_prompts]
            seen = backlog_seen(longs)
            if seen:
                assert send([7, 1000, 1001, 1002]) == 200
            assert [f.result() for f in longs] == [200] * len(long_prompts)
        backlog = _placements(server)["local/prefill_backlog"] - start["local/prefill_backlog"]
        rounds.append((seen, backlog))
        if seen and backlog > 0:
            break
    assert rounds[-1][0] and rounds[-1][1] > 0, rounds  # (backlog seen, local placements)
    after = _placements(server)
    remote = sum(v - before[k] for k, v in after.items() if k.startswith("remote/"))
    assert remote >= 2, after  # the long ones
    placed = {  # Prometheus sees the local placement at its next scrape
        sample["metric"]["where"]
        for sample in assert_data(
            prometheus,
            "sum by (where) (pdserve_prefill_placements_total)",
            False,
            "placements",
            enough=lambda result: len(result) == 2,
        )
    }
    assert placed == {"local", "remote"}, placed
    gaps = assert_data(prometheus, "pdserve_handover_gap_seconds_count", False, "hand-overs")
    assert float(gaps[0]["value"][1]) > 0


def test_promtool_accepts_a_live_scrape(server, load):
    scrape = httpx.get(f"{server.url}/metrics", timeout=10)
    assert scrape.status_code == 200
    assert scrape.headers["content-type"].startswith("text/plain")
    checked = subprocess.run(
        ["promtool", "check", "metrics"], input=scrape.text, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert 'pdserve_node_up{node="pdserve-prefill-0",pool="prefill"} 1.0' in scrape.text
    assert 'pdserve_node_up{node="pdserve-decode-0",pool="decode"} 1.0' in scrape.text


def test_bench_run_drives_the_router_and_writes_a_report(server, load, tmp_path):
    """`pdserve bench run` against the live router: every request completes, and the report
    (JSON, markdown, records, plots) says so."""
    load.stop()
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "pdserve.cli", "bench", "run", "--url", server.url]
    command += ["--workload", "random", "--prompt-range", "8", "64", "--output-range", "4", "12"]
    command += ["--arrivals", "concurrency", "--concurrency", "2", "--num-requests", "6"]
    command += ["--warmup-requests", "2", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    run = json.loads((out / "results.json").read_text())["runs"]["run"]
    assert run["completed"] == 6 and run["errors"] == 0
    assert 0 < run["ttft_s"]["p50"] < run["e2e_s"]["p50"]
    assert len((out / "records.jsonl").read_text().splitlines()) == 6
    assert "| TTFT p99 (s) |" in (out / "results.md").read_text()
    assert (out / "latency_cdf.png").stat().st_size > 10_000


MIN_STEP_RECORDS = 20


def test_calibrate_fits_the_engines_own_steps(server, load, tmp_path):
    """The engines' per-step records (GET /pdserve/v1/steps, both roles) fit the step-time model
    (`pdserve plan calibrate --url --no-traffic`: the steps this module's traffic ran), and the
    planner reads the calibration back; the live predicted/measured series are exported."""
    load.stop()
    # enough steps of both kinds whatever the earlier tests ran: distinct prompts (no prefix
    # hits), so each one is a prefill step on the prefill node and decode steps on the other
    for i in range(MIN_STEP_RECORDS):
        body = {"prompt": [1000 + 37 * i + k for k in range(12 + i)], "max_tokens": 3}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
        assert answer.status_code == 200, answer.text
    steps = httpx.get(f"{server.url}/pdserve/v1/steps", timeout=60).json()["nodes"]
    roles = {node["role"]: node for node in steps}
    assert set(roles) == {"prefill", "decode"}
    for node in steps:
        assert node["device"].startswith("cpu-") and node["device"].endswith("-1t")
        assert node["model"].endswith("-" + native_dtype(gpu=False))
        assert node["model_spec"]["num_layers"] == 30
        assert node["step_model"] == "roofline"  # no calibration in this test's cache
        assert MIN_STEP_RECORDS <= len(node["records"]) <= node["steps_seen"]
        assert node["fields"][-2:] == ["seconds", "gap_seconds"]
        assert all(len(row) == len(node["fields"]) and row[-2] > 0 for row in node["records"])
    prompts = [row for row in roles["prefill"]["records"] if row[0] > 0]
    assert prompts and all(row[2] == 0 for row in prompts)  # a prefill node decodes nothing
    # a decode leg's later steps follow a step that left it running: their gap is measured
    assert any(row[-1] is not None for row in roles["decode"]["records"])
    out = tmp_path / "calibration"
    command = [sys.executable, "-m", "pdserve.cli", "plan", "calibrate", "--url", server.url]
    done = subprocess.run(
        [*command, "--no-traffic", "--out", str(out)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    [path] = list(out.glob("*/*.json"))
    calibration = json.loads(path.read_text())
    assert calibration["fit"]["median_error"] < 0.35, calibration["fit"]
    assert calibration["step_model"]["flops"] > 1e9
    plan = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "plan", "--calibration", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plan.returncode == 0, plan.stderr
    estimates = json.loads(plan.stdout)["estimates"]
    assert estimates["source"] == "calibrated" and estimates["ttft_s"] > estimates["tpot_s"] > 0
    scrape = httpx.get(f"{server.url}/metrics", timeout=10).text
    for node in ("pdserve-prefill-0", "pdserve-decode-0"):
        assert re.search(
            rf'pdserve_node_predicted_busy_seconds_total{{model="roofline",node="{node}"', scrape
        )


# ---- the fuzzing tier (last: it leaves nothing behind, and the tests above count requests) -----

FUZZ_REQUESTS = int(os.environ.get("PDSERVE_FUZZ_REQUESTS", "200"))


def test_drawn_and_hostile_requests_get_no_5xx_kill_nothing_and_leave_nothing_held(server, load):
    from tests.helpers import fuzz

    load.stop()
    report = fuzz.run(server.url, server.headers, server.model, FUZZ_REQUESTS, seed=FUZZ_REQUESTS)
    summary = report.summary()
    print("fuzz:", summary)
    assert summary["requests"] == FUZZ_REQUESTS + len(fuzz.HOSTILE)
    assert report.problems() == []
    # the run reached the engines, not only the validation
    assert summary["statuses"].get("200", 0) > FUZZ_REQUESTS // 3
