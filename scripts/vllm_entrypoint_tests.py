"""vLLM's own OpenAI entrypoint tests, run against a server that is already up.

    python scripts/vllm_entrypoint_tests.py --url http://127.0.0.1:8001 --out vllm.json
    python scripts/vllm_entrypoint_tests.py --url http://127.0.0.1:8000 --out pdserve.json \
        --only-passed vllm.json
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
(`EXPECTED`, each with its reason). So pdserve need only run the tests that passed on vLLM's
server (`--only-passed`): the rest, about 40 % of the tests and two-thirds of the time, fail on
both with this model. The `EXPECTED` tests, whose outcome cannot count, are left out of every
run unless asked (`--with-expected`). tests/e2e/test_parity.py runs this against the parity
suite's servers.
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
from collections.abc import Iterable
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
    "entrypoints/openai/chat_completion/test_completion_with_function_calling.py",
    "entrypoints/openai/test_return_token_ids.py",
    "entrypoints/openai/test_return_tokens_as_ids.py",
    "entrypoints/openai/test_chunked_prompt.py",
    "entrypoints/openai/models/test_models.py",
    "entrypoints/openai/responses/test_basic.py",
    "entrypoints/openai/responses/test_stateful.py",
    "entrypoints/openai/responses/test_structured_output.py",
    "entrypoints/openai/responses/test_function_call.py",
    "entrypoints/serve/tokenize/test_tokenization.py",
    "entrypoints/serve/instrumentator/test_basic.py",
)
"""vLLM's server-level tests of the OpenAI face (paths under vLLM's tests/): completions, prompt
validation, chat, echo, logit bias, logprob token ids, batched chat, function calling, token ids
in and out, chunked prompts, models, the Responses API (basics, state, structured output,
function calls), tokenization, health and version. Left out: reasoning (needs `<think>` tokens),
LoRA, prompt embeddings, harmony and MCP, vLLM's engine metrics (pdserve's /metrics is its own),
and the unit tests that run vLLM's serving classes over a mock engine. A chat or Responses
request that sets no output bound is given `MAX_TOKENS` (the conftest, on both servers)."""

MAX_TOKENS = 32
"""What a request without an output bound may generate here (vLLM's would run to the context's
end: 30 s to minutes a test on a CPU). Tests that expect more then fail on both servers alike."""

DESELECTED = {
    "entrypoints/openai/chat_completion/test_completion_with_function_calling.py::"
    "test_named_tool_use": "fails on `vllm serve` with this model (greedy, its JSON never closes "
    "within 1,000 tokens, twice): 40 s on vLLM and a minute on pdserve to learn nothing",
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
    "*test_chat_echo.py::test_chat_session_with_echo_and_continue_final_message*": "samples at "
    "temperature 1 without a seed and expects the answer to stop by itself within MAX_TOKENS: "
    "chance on either server",
    "*test_completion_with_function_calling.py::test_function_tool_use*": "samples at "
    "temperature 1 without a seed: whether the model writes a valid tool call is chance on "
    "either server",
    "*responses/test_basic.py::test_instructions*": "samples at temperature 1 without a seed, "
    "then expects exact words in the answer: chance",
    "*responses/test_basic.py::test_chat_with_input_type*": "samples at temperature 1 without a "
    "seed: chance",
    "*responses/test_stateful.py::test_store*": "samples at temperature 1 without a seed: chance",
    "*test_function_call.py::test_function_calling_with_streaming_forced_tool_choice*": "samples "
    "at temperature 1 without a seed, then expects the forced call to close within MAX_TOKENS: "
    "chance (`required` passed in two of four runs on one `vllm serve`)",
}
"""Tests that may pass on `vllm serve` and fail on pdserve (fnmatch patterns of test ids), each
with its reason. Whatever they do cannot count, so `run` leaves them out unless asked
(`--with-expected`)."""

CONFTEST = '''\
"""Written by pdserve's scripts/vllm_entrypoint_tests.py in place of vLLM's root conftest: every
module gets the running server at $PDSERVE_TARGET_URL instead of a `vllm serve` of its own."""

import json
import os
from fnmatch import fnmatch
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


CAP = int(os.environ.get("PDSERVE_TARGET_MAX_TOKENS") or 0)
BOUNDS = {
    "/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/responses": ("max_output_tokens",),
}


def _bounded(data, path):
    """A chat or Responses request that sets no output bound gets CAP tokens (on both servers
    alike): unbounded, a CPU generates to the context's end, minutes a request."""
    for end, names in BOUNDS.items():
        if CAP and path.endswith(end) and all(data.get(name) is None for name in names):
            data[names[-1]] = CAP
            return True
    return False


def _served(body, path):
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    changed = _bounded(data, path)
    if isinstance(data.get("model"), str) and data["model"] != MODEL:
        data["model"] = MODEL
        changed = True
    return json.dumps(data).encode() if changed else None


def _swap(request):
    if "json" not in request.headers.get("content-type", ""):
        return request
    new = _served(request.read(), request.url.path)
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
    if isinstance(kwargs.get("json"), dict):
        data = dict(kwargs["json"])
        _bounded(data, urlsplit(str(url)).path)
        if "model" in data:
            data["model"] = MODEL
        kwargs["json"] = data
    headers = dict(kwargs.get("headers") or {})
    headers.setdefault("Authorization", f"Bearer {KEY}")
    kwargs["headers"] = headers
    return _request(self, method, url, *args, **kwargs)


requests.Session.request = _session_request

ONLY = os.environ.get("PDSERVE_TARGET_ONLY")
LEAVE = os.environ.get("PDSERVE_TARGET_LEAVE")


def _lines(path):
    with open(path) as listed:
        return listed.read().splitlines()


def pytest_collection_modifyitems(config, items):
    """With $PDSERVE_TARGET_ONLY (a file of test ids, one a line), only those tests run; with
    $PDSERVE_TARGET_LEAVE (a file of fnmatch patterns), none that matches one runs."""
    wanted = set(_lines(ONLY)) if ONLY else None
    left = _lines(LEAVE) if LEAVE else []
    keep, dropped = [], []
    for item in items:
        test_id = f"{item.location[0]}::{item.name}"
        runs = (wanted is None or test_id in wanted) and not any(fnmatch(test_id, p) for p in left)
        (keep if runs else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
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
    only: Iterable[str] | None = None,
    with_expected: bool = False,
) -> dict[str, str]:
    """Each test's outcome ("passed", "failed", "skipped") against the server at `url`; with
    `only` (test ids as `outcomes` names them), just those tests. The `EXPECTED` tests run only
    `with_expected`: no outcome of theirs can count as a regression, so they cost time (about a
    third of vLLM's run) and tell nothing."""
    tree = fetch()
    report = tree / f"report-{os.getpid()}.xml"
    listed = tree / f"only-{os.getpid()}.txt"
    leave = tree / f"leave-{os.getpid()}.txt"
    env = {
        **os.environ,
        "PDSERVE_TARGET_URL": url,
        "PDSERVE_TARGET_MODEL": served_model,
        "PDSERVE_TARGET_TOKENIZER": tokenizer,
        "PDSERVE_TARGET_KEY": api_key or "",
        "PDSERVE_TARGET_MAX_TOKENS": str(MAX_TOKENS),
        "PYTHONPATH": str(tree),
        "HF_HUB_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE", "cpu"),
    }
    if only is not None:
        only = sorted(only)
        chosen = {test_id.split("::")[0] for test_id in only}
        modules = tuple(m for m in modules if f"tests/{m}" in chosen)
        if not modules:
            return {}
        listed.write_text("".join(f"{test_id}\n" for test_id in only))
        env["PDSERVE_TARGET_ONLY"] = str(listed)
    if not with_expected:
        leave.write_text("".join(f"{pattern}\n" for pattern in EXPECTED))
        env["PDSERVE_TARGET_LEAVE"] = str(leave)
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
        listed.unlink(missing_ok=True)
        leave.unlink(missing_ok=True)


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


def passed(found: dict[str, str]) -> set[str]:
    """The tests that passed: all another server needs to run to find a regression."""
    return {test_id for test_id, outcome in found.items() if outcome == "passed"}


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
        "--only-passed",
        metavar="VLLM",
        help="an --out file of vLLM's server: run only the tests that passed there (all a "
        "regression can be found in, in about 40 % of the time)",
    )
    parser.add_argument(
        "--compare", nargs=2, metavar=("VLLM", "PDSERVE"), help="two --out files: what regressed"
    )
    parser.add_argument(
        "--with-expected",
        action="store_true",
        help="run the tests pdserve is expected to fail (EXPECTED) too; left out by default, "
        "as no outcome of theirs counts",
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
    only = passed(json.loads(Path(args.only_passed).read_text())) if args.only_passed else None
    found = run(
        args.url, args.model, tokenizer, args.api_key, only=only, with_expected=args.with_expected
    )
    print(json.dumps(counts(found)))
    if args.out:
        Path(args.out).write_text(json.dumps(found, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
