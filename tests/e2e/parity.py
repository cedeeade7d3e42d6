"""Parity cases: request bodies, and what a client observes of the answer, normalized.

Each case is sent to plain vLLM's OpenAI server and to pdserve (colocated and disaggregated), in
float32, streamed and not; `observe` reduces a response (JSON body or server-sent events) to what
must be equal: per sequence the text, finish and stop reasons, token ids, logprob tokens and
values, and the usage. Some cases are derived from plain vLLM's greedy answer (a stop string that
spans the first token and the next, the id of the third token), so they test the seam on this
host whatever the model happens to say.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

CHAT = [{"role": "user", "content": "Name a city in Egypt and describe it in one sentence."}]
COMPLETION = "The capital of France is"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
    "additionalProperties": False,
}
GRAMMAR = 'root ::= ("yes" | "no") " because " [a-z ]{1,20}'


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # completion | chat | responses | tokenize | detokenize | messages | scoring
    body: dict
    stream: bool = False


def completion(name: str, stream: bool = False, **body: Any) -> Case:
    return Case(name, "completion", {"prompt": COMPLETION, "temperature": 0, **body}, stream)


def chat(name: str, stream: bool = False, **body: Any) -> Case:
    return Case(name, "chat", {"messages": CHAT, "temperature": 0, **body}, stream)


def cases(long_prompt: list[int], full: bool) -> list[Case]:
    """The requests every system answers. `long_prompt`: corpus token ids for length cases."""
    sampled = {"temperature": 1.0, "seed": 1234}
    base = [
        completion("greedy", max_tokens=16, logprobs=0, return_token_ids=True),
        completion("greedy-stream", True, max_tokens=16, stream_options={"include_usage": True}),
        chat("chat-greedy", max_tokens=24),
        chat("chat-greedy-stream", True, max_tokens=24, stream_options={"include_usage": True}),
        completion("min-tokens", max_tokens=12, min_tokens=8, stop=["\n"]),
        completion("ignore-eos", max_tokens=12, ignore_eos=True),
        completion("presence-penalty", max_tokens=16, presence_penalty=1.5),
        completion("frequency-penalty", max_tokens=16, frequency_penalty=1.5),
        completion("repetition-penalty", max_tokens=16, repetition_penalty=1.3),
        completion("bad-words", max_tokens=12, bad_words=[" Paris", " the city"]),
        completion("seed", max_tokens=16, **sampled),
        completion("seed-stream", True, max_tokens=16, **sampled),
        completion("logprobs", max_tokens=8, logprobs=2),
        completion("logprobs-stream", True, max_tokens=8, logprobs=2),
        completion("echo-logprobs", max_tokens=4, echo=True, logprobs=1),
        completion("echo-only", max_tokens=0, echo=True),
        completion("prompt-logprobs", max_tokens=4, prompt_logprobs=2),
        chat("chat-logprobs", max_tokens=8, logprobs=True, top_logprobs=2),
        chat("chat-logprobs-stream", True, max_tokens=8, logprobs=True, top_logprobs=2),
        completion("n", max_tokens=8, n=3, **sampled),
        chat("chat-n-stream", True, max_tokens=8, n=2, **sampled),
        chat("max-completion-tokens", max_completion_tokens=7),
        chat("json-object", max_tokens=60, response_format={"type": "json_object"}),
        chat(
            "json-schema",
            max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
        ),
        completion(
            "choice", max_tokens=10, structured_outputs={"choice": ["yes, it is", "no, it is not"]}
        ),
        completion("regex", max_tokens=12, structured_outputs={"regex": r"[A-Z][a-z]{2,8}\."}),
        completion("json", max_tokens=40, structured_outputs={"json": SCHEMA}),
        completion("grammar", max_tokens=16, structured_outputs={"grammar": GRAMMAR}),
        completion(
            "continuous-usage",
            True,
            max_tokens=5,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        ),
        Case(
            "prompt-1-token",
            "completion",
            {"prompt": long_prompt[:1], "max_tokens": 8, "temperature": 0},
        ),
        Case(
            "prompt-127",
            "completion",
            {"prompt": long_prompt[:127], "max_tokens": 8, "temperature": 0},
        ),
        Case(
            "prompt-129",
            "completion",
            {"prompt": long_prompt[:129], "max_tokens": 8, "temperature": 0},
        ),
        Case(
            "prompt-max-len-1",
            "completion",
            {"prompt": long_prompt[:2047], "max_tokens": 1, "temperature": 0},
        ),
        Case(
            "cached-tokens",
            "completion",
            {"prompt": long_prompt[:300], "max_tokens": 4, "temperature": 0},
        ),
        Case(  # the same prompt under a tenant's salt: none of the blocks above are shared
            "cache-salt",
            "completion",
            {"prompt": long_prompt[:300], "max_tokens": 4, "temperature": 0, "cache_salt": "b"},
        ),
        *salted_twins(long_prompt),
        completion("logprob-token-ids", max_tokens=6, logprobs=3, logprob_token_ids=IDS),
        completion(
            "logprob-token-ids-stream", True, max_tokens=6, logprobs=3, logprob_token_ids=IDS
        ),
        chat("chat-logprob-token-ids", max_tokens=6, logprobs=True, logprob_token_ids=IDS),
        chat("tools", max_tokens=8, tools=[_TOOL], tool_choice="auto"),
        chat("tools-auto-stream", True, max_tokens=24, tools=[_TOOL], tool_choice="auto"),
        chat("tools-required", max_tokens=120, tools=[_TOOL], tool_choice="required"),
        chat("tools-required-stream", True, max_tokens=120, tools=[_TOOL], tool_choice="required"),
        chat("tools-named", max_tokens=120, tools=[_TOOL], tool_choice=_NAMED),
        chat("tools-named-stream", True, max_tokens=120, tools=[_TOOL], tool_choice=_NAMED),
        Case("responses", "responses", {"input": COMPLETION, **_RESPONSES}),
        Case("responses-stream", "responses", {"input": COMPLETION, **_RESPONSES}, True),
        Case(
            "responses-chat",
            "responses",
            {"input": CHAT, "instructions": "Be brief.", **_RESPONSES},
        ),
        Case("tokenize", "tokenize", {"prompt": COMPLETION}),
        Case("tokenize-chat", "tokenize", {"messages": CHAT, "add_generation_prompt": True}),
        Case("detokenize", "detokenize", {"tokens": long_prompt[:40]}),
        # vLLM's grammar finds no token for an unassigned code point and ends the request with
        # an error (a 500): the engine's own, not a KV hand-over's
        completion("grammar-error", max_tokens=4, structured_outputs={"regex": "\U000bba58"}),
        # the Anthropic Messages API and generative scoring: vLLM's routes over the same engines
        Case("messages", "messages", {"messages": CHAT, **_MESSAGES}),
        Case("messages-stream", "messages", {"messages": CHAT, **_MESSAGES}, True),
        Case(
            "messages-stop",
            "messages",
            # a space: in any answer of 16 tokens, whatever the model says on this host
            {"messages": CHAT, "system": "Be brief.", "stop_sequences": [" ", "."], **_MESSAGES},
        ),
        Case(
            "scoring",
            "scoring",
            {"query": COMPLETION, "items": [" Paris", " Lyon"], "label_token_ids": long_prompt[:3]},
        ),
        completion("priority", max_tokens=4, priority=3),
        # refused by vLLM unless it is told to trust request templates: the same here
        chat("request-chat-template", max_tokens=4, chat_template="{{ 'A' * 9 }}"),
        chat("template-kwargs-template", max_tokens=4, chat_template_kwargs={"chat_template": "A"}),
        chat("template-kwargs-tokenize", max_tokens=4, chat_template_kwargs={"tokenize": True}),
    ]
    if full:
        base += [
            Case(
                f"prompt-{n}",
                "completion",
                {"prompt": long_prompt[:n], "max_tokens": 16, "temperature": 0},
            )
            for n in (2, 128, 255, 256, 257, 1023, 1500)
        ]
        base += [
            completion("stop-token-ids-stream", True, max_tokens=16, stop_token_ids=[2]),
            completion(
                "choice-stream", True, max_tokens=10, structured_outputs={"choice": ["yes", "no"]}
            ),
            chat(
                "json-schema-stream",
                True,
                max_tokens=60,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": SCHEMA},
                },
            ),
        ]
    return base


IDS = [30, 1000, 2000]
"""Token ids whose logprobs `logprob_token_ids` asks for at every position."""

WIDE = (
    "Complete this sentence with emojis: I love coding 🚀",
    "Reply with three emojis only: 🎉",
    "天空是什么颜色？请用中文回答。",
    "日本の首都はどこですか？日本語で答えてください。",
    "한국의 수도는 어디입니까? 한국어로 대답하세요.",
    "Write the word café and then naïve with combining accents: cafe\u0301",
    "Answer with emojis only: what is the weather like today? ☀️",
    "Translate to Chinese: good morning, my friend.",
    "用中文写一句关于春天的话。",
    "请列出三种水果的中文名字。",
    "東京タワーについて一文で説明してください。",
    "ひらがなで「ありがとう」と書いてください。",
    "김치는 무엇입니까? 한 문장으로 답하세요.",
    "Describe a party using only emojis: 🎂🎈",
    "Write 'hello' in Russian, Greek and Hindi: привет,",
    "Finish with a flag emoji: the country I visited was 🇯🇵",
    "Say thank you in Arabic and Hebrew: شكرا",
    "春天来了，",
    "我今天很高兴，因为",
    "中国的首都是",
    "请用中文介绍一下你自己：",
    "一二三四五六七八",
    "北京、上海、广州、",
    "猫和狗哪个更可爱？",
    "今日はいい天気ですね。",
    "私の名前は",
    "桜の花が",
    "おはようございます、",
    "カタカナで書いてください：コンピューター、",
    "서울은",
    "안녕하세요, 저는",
    "오늘 날씨가",
    "Emoji story: 🐶🏠🌧️",
    "Reply with a heart emoji: ❤️",
    "Rate this movie with stars: ⭐⭐⭐",
    "Food emojis: 🍕🍔🍟",
    "Animals: 🐱🐭🐹🐰",
    "Weather report in emojis: ⛅🌈",
    "Count with keycap emojis: 1️⃣ 2️⃣",
    "Family emoji: 👨‍👩‍👧",
    "Skin tones: 👍🏽👋🏿",
    "Mixed: I ❤️ 東京 and 서울 and",
    "Math symbols: ∑∫∂√∞≈",
    "Greek alphabet: αβγδε",
    "Russian: Москва — столица",
    "Hindi: नमस्ते, मेरा नाम",
    "Thai: สวัสดีครับ",
    "Accents: crème brûlée, jalapeño, façade,",
    "Combining marks: e\u0301 a\u0300 o\u0302 u\u0308",
    "Fullwidth: ＡＢＣ１２３",
)
"""Prompts whose answers (or whose prompts' ends) hold characters of several byte-level tokens:
the first token the prefill node samples may end halfway through one."""


def wide_characters() -> list[Case]:
    """Two cases a prompt: a completion and a chat, one of them streamed."""
    found = []
    for i, prompt in enumerate(WIDE):
        body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
        found.append(
            Case(f"wide-{i}" + ("-stream" if i % 2 else ""), "completion", body, i % 2 == 1)
        )
        found.append(chat(f"chat-wide-{i}", i % 2 == 0, max_tokens=12, messages=[
            {"role": "user", "content": prompt}
        ]))  # fmt: skip
    return found


def salted_twins(long_prompt: list[int]) -> list[Case]:
    """A tenant's salted prompt on each path where the decode node samples the first token (a
    stop string, n > 1, a structured output), each followed by the same prompt unsalted: the
    twin must find none of the tenant's blocks (usage's cached tokens equal vLLM's: 0). Prompts
    no earlier case starts with."""
    found = []
    ways = {
        "stop": {"stop": ["@@@@"]},
        "n": {"n": 2, "temperature": 1.0, "seed": 7},
        "json": {"structured_outputs": {"json": SCHEMA}},
    }
    for i, (way, fields) in enumerate(ways.items()):
        prompt = long_prompt[600 + 300 * i : 900 + 300 * i]
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
        salted = {**body, **fields, "cache_salt": "t"}
        # (the salted request's own cache hits are not compared: with n = 2 vLLM counts the
        # second sequence's hits on the first's blocks, pdserve the prefill's)
        found.append(Case(f"salted-{way}", "completion", salted))
        found.append(Case(f"cached-salt-{way}-twin", "completion", body))
    return found


_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
_NAMED = {"type": "function", "function": {"name": "weather"}}
_RESPONSES = {"max_output_tokens": 16, "temperature": 0}
_MESSAGES = {"model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0}

TOOL_FLAGS = ("--tool-call-parser", "hermes", "--enable-auto-tool-choice")
"""`vllm serve` flags every parity server gets (with `--chat-template`: tools_chat_template.jinja
beside this file, the served model's own template shows the model no tools)."""
TOOLS_TEMPLATE = Path(__file__).with_name("tools_chat_template.jinja")


def reasoning_cases() -> list[Case]:
    """The cases for servers with a reasoning parser (`--reasoning-parser granite`: it reads
    plain text, "Here is my thought process: … Here is my response: …", so this model's
    tokenizer serves)."""
    asked = [
        {
            "role": "user",
            "content": "Start with 'Here is my thought process:', think about Egypt, then write "
            "'Here is my response:' and name its capital.",
        }
    ]
    return [
        chat("reasoning", max_tokens=48, messages=asked),
        chat("reasoning-stream", True, max_tokens=48, messages=asked),
        chat(
            "reasoning-json", max_tokens=48, messages=asked, response_format={"type": "json_object"}
        ),
        completion("reasoning-choice", max_tokens=10, structured_outputs={"choice": ["yes", "no"]}),
    ]


def derived(reference: dict) -> list[Case]:
    """Cases built from plain vLLM's greedy answer on this host (the "greedy" case)."""
    choice = reference["choices"][0]
    tokens, ids = choice["tokens"], choice["token_ids"]
    first = tokens[0]
    # starts inside the first token's text, ends inside the third token's
    span = first[-min(2, len(first)) :] + tokens[1] + tokens[2][:1]
    return [
        completion("stop-spanning-first-token", max_tokens=16, stop=[span]),
        completion("stop-spanning-stream", True, max_tokens=16, stop=[span]),
        completion("stop-include", max_tokens=16, stop=[span], include_stop_str_in_output=True),
        completion("stop-token-id", max_tokens=16, stop_token_ids=[ids[2]]),
        completion("logit-bias", max_tokens=8, logit_bias={str(ids[0]): -100}),
        completion("allowed-token-ids", max_tokens=6, allowed_token_ids=sorted(set(ids[:6]))),
    ]


PATHS = {
    "completion": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
    "messages": "/v1/messages",
    "scoring": "/generative_scoring",
}


def send(url: str, case: Case) -> dict:
    """Send one case; returns what the client observes."""
    path = PATHS[case.kind]
    body = {**case.body, "stream": case.stream} if case.kind in GENERATE else case.body
    with httpx.Client(base_url=url, timeout=300) as client:
        if not case.stream:
            response = client.post(path, json=body)
            if response.status_code >= 500:  # what the server says went wrong, too
                return {"status": response.status_code, "error": response.json()["error"]}
            if response.status_code != 200:
                return {"status": response.status_code}
            if case.kind == "scoring":
                return observe_scores(response.json())
            if case.kind not in GENERATE:
                return {"status": 200, **response.json()}
            if case.kind == "responses":
                return observe_response(response.json())
            if case.kind == "messages":
                return observe_message(response.json())
            return observe(case.kind, response.json())
        with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                response.read()
                return {"status": response.status_code}
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    if case.kind == "responses":
        return observe_response_stream([json.loads(e) for e in events])
    if case.kind == "messages":
        return observe_message_stream([json.loads(e) for e in events])
    assert events[-1] == "[DONE]", events[-3:]
    return observe_stream(case.kind, [json.loads(e) for e in events[:-1]])


GENERATE = ("completion", "chat", "responses", "messages")

IN_ORDER = ("cached", "salted", "cache-salt")
"""Cases whose answer depends on what the server cached before them (usage's cached tokens,
a tenant's twin): sent one by one, in their order, after all the others."""


def send_all(url: str, cases: list[Case], at_once: int = 4) -> dict[str, dict]:
    """Every case's observation by name: `at_once` in flight (the engines batch them, as they
    batch any clients'; in float32 a greedy token does not depend on its batch), then the
    `IN_ORDER` ones one by one, so each server sees the same history before them."""
    free = [case for case in cases if not case.name.startswith(IN_ORDER)]
    with ThreadPoolExecutor(at_once) as pool:
        answers = pool.map(lambda case: send(url, case), free)
        seen = dict(zip([case.name for case in free], answers, strict=True))
    seen.update({case.name: send(url, case) for case in cases if case.name not in seen})
    return {case.name: seen[case.name] for case in cases}


def observe_response(body: dict) -> dict:
    """A Responses API answer: its output items' kinds and texts, and its token counts (ids
    are the server's own)."""
    items = []
    for item in body["output"]:
        texts = [part.get("text") for part in item.get("content") or ()]
        items.append((item["type"], texts))
    usage = body.get("usage") or {}
    return {
        "status": 200,
        "state": body["status"],
        "output": items,
        "usage": (usage.get("input_tokens"), usage.get("output_tokens")),
    }


def observe_response_stream(events: list[dict]) -> dict:
    text = "".join(e["delta"] for e in events if e.get("type") == "response.output_text.delta")
    done = [e["response"] for e in events if e.get("type") == "response.completed"]
    final = observe_response(done[-1]) if done else None
    return {
        "status": 200,
        "text": text,
        "final": final,
        "kinds": sorted({e["type"] for e in events}),
    }


def observe_message(body: dict) -> dict:
    """An Anthropic Messages answer: its content blocks, why it stopped and its token counts
    (the id is the server's own)."""
    return {
        "status": 200,
        "content": [(block["type"], block.get("text")) for block in body["content"]],
        "stop": (body["stop_reason"], body.get("stop_sequence")),
        "usage": (body["usage"]["input_tokens"], body["usage"]["output_tokens"]),
    }


def observe_message_stream(events: list[dict]) -> dict:
    deltas = [e["delta"] for e in events if e.get("type") == "content_block_delta"]
    end = next((e for e in reversed(events) if e.get("type") == "message_delta"), {})
    usage = end.get("usage") or {}
    return {
        "status": 200,
        "text": "".join(delta.get("text", "") for delta in deltas),
        "kinds": [e["type"] for e in events if e["type"] != "content_block_delta"],
        "stop": end.get("delta"),
        "usage": (usage.get("input_tokens"), usage.get("output_tokens")),
    }


def observe_scores(body: dict) -> dict:
    """Generative scoring: each item's probability of the first label token (floats: compared
    within `differences`' tolerance) and the token counts."""
    usage = body["usage"]
    return {
        "status": 200,
        "scores": [(item["index"], item["score"]) for item in body["data"]],
        "usage": (usage["prompt_tokens"], usage["completion_tokens"]),
    }


def observe(kind: str, body: dict) -> dict:
    choices = {}
    for choice in body["choices"]:
        text = choice["text"] if kind == "completion" else choice["message"]["content"]
        seen = {
            "text": text,
            "finish_reason": choice["finish_reason"],
            "stop_reason": choice.get("stop_reason"),
            "token_ids": choice.get("token_ids"),
        }
        if kind == "chat":  # a call's id is the server's own: its name and arguments compare
            message = choice["message"]
            calls = message.get("tool_calls") or []
            seen["tool_calls"] = [
                (c["function"]["name"], c["function"]["arguments"]) for c in calls
            ]
            seen["reasoning"] = message.get("reasoning")
        seen.update(_logprobs(kind, choice.get("logprobs")))
        choices[choice["index"]] = seen
    prompt_logprobs = body.get("prompt_logprobs") or (
        body["choices"][0].get("prompt_logprobs") if body["choices"] else None
    )
    return {
        "status": 200,
        "choices": choices,
        "usage": _usage(body.get("usage")),
        "prompt_logprobs": prompt_logprobs,
    }


def observe_stream(kind: str, chunks: list[dict]) -> dict:
    choices: dict[int, dict] = {}
    usages = [chunk["usage"] for chunk in chunks if chunk.get("usage")]
    for chunk in chunks:
        for choice in chunk["choices"]:
            seen = choices.setdefault(
                choice["index"],
                {
                    "text": "",
                    "finish_reason": None,
                    "stop_reason": None,
                    "tokens": [],
                    "values": [],
                    "tool_calls": {},
                    "reasoning": "",
                },
            )
            if kind == "completion":
                seen["text"] += choice.get("text") or ""
            else:
                delta = choice.get("delta") or {}
                seen["text"] += delta.get("content") or ""
                seen["reasoning"] += delta.get("reasoning") or ""
                for call in delta.get("tool_calls") or ():
                    name, arguments = seen["tool_calls"].get(call["index"], ("", ""))
                    function = call.get("function") or {}
                    name += function.get("name") or ""
                    arguments += function.get("arguments") or ""
                    seen["tool_calls"][call["index"]] = (name, arguments)
            if choice.get("finish_reason"):
                seen["finish_reason"] = choice["finish_reason"]
                seen["stop_reason"] = choice.get("stop_reason")
            more = _logprobs(kind, choice.get("logprobs"))
            seen["tokens"] += more.get("tokens", [])
            seen["values"] += more.get("values", [])
    return {
        "status": 200,
        "choices": choices,
        "usage": _usage(usages[-1]) if usages else None,
        "usage_chunks": len(usages),
    }


def _logprobs(kind: str, logprobs: dict | None) -> dict:
    if not logprobs:
        return {}
    if kind == "completion":
        tops = [sorted(top.items()) if top else None for top in logprobs["top_logprobs"]]
        return {"tokens": logprobs["tokens"], "values": logprobs["token_logprobs"], "tops": tops}
    content = logprobs["content"] or []
    return {
        "tokens": [item["token"] for item in content],
        "values": [item["logprob"] for item in content],
        "tops": [[(t["token"], t["logprob"]) for t in item["top_logprobs"]] for item in content],
    }


def _usage(usage: dict | None) -> tuple | None:
    if not usage:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return usage["prompt_tokens"], usage["completion_tokens"], cached


def differences(expected: Any, got: Any, where: str = "") -> list[str]:
    """Where `got` differs from `expected`: exactly, but floats within 1e-3 (the decode engine
    may compute the first token's position as a decode step; float32 keeps that close)."""
    if isinstance(expected, float) and isinstance(got, float):
        return (
            [] if math.isclose(expected, got, abs_tol=1e-3) else [f"{where}: {expected} != {got}"]
        )
    if isinstance(expected, dict) and isinstance(got, dict):
        keys = set(expected) | set(got)
        return [
            d
            for k in sorted(keys, key=str)
            for d in differences(expected.get(k), got.get(k), f"{where}.{k}")
        ]
    if isinstance(expected, list | tuple) and isinstance(got, list | tuple):
        if len(expected) != len(got):
            return [f"{where}: length {len(expected)} != {len(got)}"]
        return [
            d
            for i, (a, b) in enumerate(zip(expected, got, strict=True))
            for d in differences(a, b, f"{where}[{i}]")
        ]
    return [] if expected == got else [f"{where}: {expected!r} != {got!r}"]
