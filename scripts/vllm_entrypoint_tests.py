"""vLLM's own OpenAI entrypoint tests, run against a server that is already up.

    python scripts/vllm_entrypoint_tests.py --url http://127.0.0.1:8000 --out pdserve.json
    python scripts/vllm_entrypoint_tests.py --url http://127.0.0.1:8001 --out vllm.json
    python scripts/vllm_entrypoint_tests.py --compare vllm.json pdserve.json

The tests come from vLLM's source distribution for the pinned version on the package registry
(downloaded once into ~/.cache/pdserve/vllm-tests, its checksum checked; nothing of vLLM's is
kept in this repository). Each module's `server` fixture would start a `vllm serve` of its own;
here vLLM's root conftest is replaced by one that hands every module the running server instead
(`RemoteOpenAIServer` → the server at --url), sends every request under the served model's name
whatever model the module names, and loads the served model's tokenizer wherever a module asks
for its own. No test file is changed.

A module's tests then run against the running server's flags, not the module's: start both
servers with `FLAGS` and the same model and dtype (float32, for equal greedy text). Tests that
hard-code another model's text fail on both servers; what counts is a test that passes on
`vllm serve` and fails on pdserve (`--compare`), less the differences pdserve makes on purpose
(`EXPECTED`, each with its reason). tests/e2e/test_parity.py runs this against the parity suite's
servers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import xml.etree.ElementTree as ET
from fnmatch import fnmatch
from pathlib import Path

VERSION = "0.32.0"
SDIST = (
    "https://files.pythonhosted.org/packages/d5/df/"
    "5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz"
)
SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
CACHE = Path.home() / ".cache" / "pdserve" / "vllm-tests"

MODULES = (
    "entrypoints/openai/completion/test_completion.py",
    "entrypoints/openai/completion/test_prompt_validation.py",
    "entrypoints/openai/completion/test_token_in_token_out.py",
    "entrypoints/openai/chat_completion/test_chat.py",
    "entrypoints/openai/chat_completion/test_chat_completion.py",
    "entrypoints/openai/chat_completion/test_chat_echo.py",
    "entrypoints/openai/chat_completion/test_chat_logit_bias_validation.py",
    "entrypoints/openai/chat_completion/test_logprob_token_ids.py",
    "entrypoints/openai/chat_completion/test_batched_chat_completions.py",
    "entrypoints/openai/test_return_token_ids.py",
    "entrypoints/openai/test_return_tokens_as_ids.py",
    "entrypoints/openai/test_chunked_prompt.py",
    "entrypoints/openai/models/test_models.py",
    "entrypoints/openai/responses/test_basic.py",
    "entrypoints/openai/responses/test_stateful.py",
    "entrypoints/openai/responses/test_structured_output.py",
    "entrypoints/serve/tokenize/test_tokenization.py",
    "entrypoints/serve/instrumentator/test_basic.py",
)
"""vLLM's server-level tests of the OpenAI face (paths under vLLM's tests/): completions, prompt
validation, chat, echo, logit bias, logprob token ids, batched chat, function calling, token ids
in and out, chunked prompts, models, the Responses API (basics, state, structured output,
function calls), tokenization, health and version. Left out: reasoning (needs `<think>` tokens),
LoRA, prompt embeddings, harmony and MCP, vLLM's engine metrics (pdserve's /metrics is its own),
the unit tests that run vLLM's serving classes over a mock engine, and the two function-calling
modules (chat's and the Responses API's): their requests set no `max_tokens`, so on a CPU each
generates to the context's end, 30 s to minutes a test on either server."""

DESELECTED = {
    "entrypoints/openai/chat_completion/test_chat_echo.py::"
    "test_chat_session_with_echo_and_continue_final_message": "no max_tokens: generates to the "
    "context's end, minutes on a CPU",
    "entrypoints/openai/responses/test_basic.py::test_instructions": "no max_output_tokens: "
    "generates to the context's end, minutes on a CPU",
    "entrypoints/openai/responses/test_stateful.py::test_cancel_completed": "waits for a "
    "background response that generates to the context's end, minutes on a CPU",
    "entrypoints/openai/responses/test_basic.py::test_chat_with_input_type": "no "
    "max_output_tokens at temperature 1: how long it generates is chance (seconds to minutes)",
    "entrypoints/openai/responses/test_stateful.py::test_store": "no max_output_tokens at "
    "temperature 1: how long it generates is chance (seconds to minutes)",
}
"""Tests of the chosen modules left out (node id prefixes), each with its reason."""

FLAGS = (
    "--enable-prompt-tokens-details",
    "--enable-tokenizer-info-endpoint",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
)
"""The front-end flags both servers need for these modules (pdserve: `router.vllm_args`, and
`router.enable_prompt_tokens_details` for the first)."""

EXPECTED = {
    "*::test_*beam_search*": "beam search is refused with 400 by design (docs/api.md): its "
    "beams would each need the whole KV on one engine",
    "*test_completion.py::test_echo_logprob_completion*": "samples at temperature 1 without a "
    "seed: which tokens come is chance on either server",
    "*test_chat.py::test_more_than_one_prompt_logprobs*": "samples at temperature 1 without a "
    "seed: which tokens come is chance on either server",
    "*test_completion.py::test_batch_completions*": "one of its requests asks for beam search, "
    "refused with 400 by design (docs/api.md)",
    "*responses/test_structured_output.py::test_structured_output": "samples at the model's "
    "default temperature (1) without a seed, then expects one exact event name: chance",
}
"""Tests that may pass on `vllm serve` and fail on pdserve (fnmatch patterns of test ids), each
with its reason."""

CONFTEST = '''\
"""Written by pdserve's scripts/vllm_entrypoint_tests.py in place of vLLM's root conftest: every
module gets the running server at $PDSERVE_TARGET_URL instead of a `vllm serve` of its own."""

import json
import os
from urllib.parse import urlsplit

import httpx
import openai
import requests

import tests.utils as utils
import vllm.tokenizers

URL = os.environ["PDSERVE_TARGET_URL"].rstrip("/")
MODEL = os.environ["PDSERVE_TARGET_MODEL"]
KEY = os.environ.get("PDSERVE_TARGET_KEY") or "EMPTY"
TOKENIZER = os.environ["PDSERVE_TARGET_TOKENIZER"]
_get_tokenizer = vllm.tokenizers.get_tokenizer


def _served(body):
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if isinstance(data, dict) and isinstance(data.get("model"), str) and data["model"] != MODEL:
        data["model"] = MODEL
        return json.dumps(data).encode()
    return None


def _swap(request):
    if "json" not in request.headers.get("content-type", ""):
        return request
    new = _served(request.read())
    if new is None:
        return request
    headers = dict(request.headers)
    headers["content-length"] = str(len(new))
    return httpx.Request(request.method, request.url, headers=headers, content=new,
                         extensions=request.extensions)


class _Swap(httpx.HTTPTransport):
    def handle_request(self, request):
        return super().handle_request(_swap(request))


class _AsyncSwap(httpx.AsyncHTTPTransport):
    async def handle_async_request(self, request):
        return await super().handle_async_request(_swap(request))


class Attached:
    """`RemoteOpenAIServer`'s face over the running server; the module's model and arguments
    are ignored (the running server's apply)."""

    def __init__(self, *args, **kwargs):
        parts = urlsplit(URL)
        self.host, self.port = parts.hostname, parts.port
        self.url_root = URL

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def url_for(self, *parts):
        return "/".join([URL, *parts])

    def get_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        kwargs.setdefault("max_retries", 0)
        client = httpx.Client(transport=_Swap(), timeout=kwargs["timeout"])
        return openai.OpenAI(base_url=URL + "/v1", api_key=KEY, http_client=client, **kwargs)

    def get_async_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        kwargs.setdefault("max_retries", 0)
        client = httpx.AsyncClient(transport=_AsyncSwap(), timeout=kwargs["timeout"])
        return openai.AsyncOpenAI(base_url=URL + "/v1", api_key=KEY, http_client=client, **kwargs)


utils.RemoteOpenAIServer = Attached
vllm.tokenizers.get_tokenizer = lambda *args, **kwargs: _get_tokenizer(TOKENIZER)
_request = requests.Session.request


def _session_request(self, method, url, *args, **kwargs):
    if isinstance(kwargs.get("json"), dict) and "model" in kwargs["json"]:
        kwargs["json"] = {**kwargs["json"], "model": MODEL}
    headers = dict(kwargs.get("headers") or {})
    headers.setdefault("Authorization", f"Bearer {KEY}")
    kwargs["headers"] = headers
    return _request(self, method, url, *args, **kwargs)


requests.Session.request = _session_request
'''

PYTEST_INI = """\
[pytest]
asyncio_mode = auto
asyncio_default_fixture_loop_scope = function
addopts = -p no:cacheprovider -q
timeout = 90
"""


def _download(path: Path, attempts: int = 3) -> None:
    part = path.with_suffix(".part")
    for attempt in range(1, attempts + 1):
        try:
            with urllib.request.urlopen(SDIST, timeout=120) as answer, part.open("wb") as out:
                shutil.copyfileobj(answer, out)
            break
        except OSError as error:  # a dropped connection: the registry is usually back at once
            if attempt == attempts:
                raise RuntimeError(f"{SDIST}: {error} ({attempts} attempts)") from None
    digest = hashlib.sha256(part.read_bytes()).hexdigest()
    if digest != SHA256:
        part.unlink()
        raise RuntimeError(f"{SDIST}: sha256 {digest}, expected {SHA256}")
    part.rename(path)


def fetch(cache: Path = CACHE) -> Path:
    """vLLM's test tree for `VERSION` with this conftest in place of its own (downloaded and
    unpacked once); returns the folder to run pytest in."""
    root = cache / VERSION
    tree = root / f"vllm-{VERSION}"
    ready = root / ".ready"
    if not ready.is_file():
        root.mkdir(parents=True, exist_ok=True)
        sdist = root / f"vllm-{VERSION}.tar.gz"
        if not sdist.is_file():
            _download(sdist)
        shutil.rmtree(tree, ignore_errors=True)
        with tarfile.open(sdist) as archive:
            members = [
                m for m in archive.getmembers() if m.name.startswith(f"vllm-{VERSION}/tests/")
            ]
            archive.extractall(root, members=members, filter="data")
        ready.write_text(VERSION)
    (tree / "tests" / "conftest.py").write_text(CONFTEST)
    (tree / "pytest.ini").write_text(PYTEST_INI)
    return tree


def run(
    url: str,
    served_model: str,
    tokenizer: str,
    api_key: str | None = None,
    modules: tuple[str, ...] = MODULES,
    timeout_s: float = 900.0,
) -> dict[str, str]:
    """Each test's outcome ("passed", "failed", "skipped") against the server at `url`."""
    tree = fetch()
    report = tree / f"report-{os.getpid()}.xml"
    env = {
        **os.environ,
        "PDSERVE_TARGET_URL": url,
        "PDSERVE_TARGET_MODEL": served_model,
        "PDSERVE_TARGET_TOKENIZER": tokenizer,
        "PDSERVE_TARGET_KEY": api_key or "",
        "PYTHONPATH": str(tree),
        "HF_HUB_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE", "cpu"),
    }
    command = [sys.executable, "-m", "pytest", *(f"tests/{m}" for m in modules)]
    command += [f"--deselect=tests/{test_id}" for test_id in DESELECTED]
    command += [f"--junitxml={report}", "-o", "junit_family=xunit1"]
    done = subprocess.run(
        command, cwd=tree, env=env, timeout=timeout_s, capture_output=True, text=True
    )
    if not report.is_file():  # pytest did not get as far as running tests
        raise RuntimeError(
            f"vLLM's tests did not run (exit {done.returncode}):\n{done.stdout[-2000:]}"
        )
    try:
        return outcomes(report)
    finally:
        report.unlink(missing_ok=True)


def outcomes(report: Path) -> dict[str, str]:
    found = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        test_id = f"{case.get('file') or case.get('classname')}::{case.get('name')}"
        if case.find("skipped") is not None:
            found[test_id] = "skipped"
        elif case.find("failure") is not None or case.find("error") is not None:
            found[test_id] = "failed"
        else:
            found[test_id] = "passed"
    return found


def expected(test_id: str) -> str | None:
    """Why `test_id` may fail on pdserve and pass on vLLM (None: it may not)."""
    return next((why for pattern, why in EXPECTED.items() if fnmatch(test_id, pattern)), None)


def regressions(vllm: dict[str, str], pdserve: dict[str, str]) -> list[str]:
    """Tests that pass on vLLM's server and do not on pdserve, less the expected ones."""
    return sorted(
        test_id
        for test_id, outcome in vllm.items()
        if outcome == "passed" and pdserve.get(test_id) != "passed" and not expected(test_id)
    )


def counts(found: dict[str, str]) -> dict[str, int]:
    return {
        kind: sum(1 for o in found.values() if o == kind)
        for kind in ("passed", "failed", "skipped")
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="the running server (http://host:port)")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="its served model name")
    parser.add_argument("--tokenizer", help="the served model's folder (default: pdserve's model)")
    parser.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    parser.add_argument("--out", help="write each test's outcome here (JSON)")
    parser.add_argument(
        "--compare", nargs=2, metavar=("VLLM", "PDSERVE"), help="two --out files: what regressed"
    )
    args = parser.parse_args(argv)
    if args.compare:
        vllm, pdserve = (json.loads(Path(p).read_text()) for p in args.compare)
        print(f"vllm: {counts(vllm)}; pdserve: {counts(pdserve)}")
        for test_id, outcome in sorted(vllm.items()):
            if outcome == "passed" and pdserve.get(test_id) != "passed" and expected(test_id):
                print(f"expected: {test_id}: {expected(test_id)}")
        regressed = regressions(vllm, pdserve)
        for test_id in regressed:
            print(f"REGRESSED: {test_id}")
        return 1 if regressed else 0
    if not args.url:
        parser.error("give --url (a running server) or --compare")
    tokenizer = args.tokenizer
    if tokenizer is None:
        from pdserve_core.model_prep import prepare_default_model

        tokenizer = str(prepare_default_model())
    found = run(args.url, args.model, tokenizer, args.api_key)
    print(json.dumps(counts(found)))
    if args.out:
        Path(args.out).write_text(json.dumps(found, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
