"""The fuzzing tier's own judgement of an answer (tests/helpers/fuzz.py), on made-up answers."""

from __future__ import annotations

import json

from tests.helpers.fuzz import PROMPTS, _leaked

EMOJI = PROMPTS[1]


def _sse(*texts: str) -> str:
    events = [json.dumps({"choices": [{"index": 0, "text": t}]}) for t in texts]
    return "".join(f"data: {e}\n\n" for e in events) + "data: [DONE]\n\n"


def test_an_answer_that_repeats_its_prompt_is_a_leak():
    body = {"prompt": EMOJI, "max_tokens": 8}
    leaked = json.dumps({"choices": [{"text": EMOJI + "💡💬"}]})
    assert "prompt's text" in _leaked(body, 200, leaked)
    assert "prompt's text" in _leaked(body, 200, _sse("", EMOJI + "💡", "💬"))
    assert _leaked(body, 200, _sse("", "💡", "💬")) == ""
    assert _leaked({**body, "echo": True}, 200, leaked) == ""  # asked for
    assert _leaked({"prompt": "The sea is"}, 200, _sse("The sea is")) == ""  # plain: not judged
