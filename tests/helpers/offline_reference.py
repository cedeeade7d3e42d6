"""Greedy reference outputs from plain vLLM (offline `LLM`), one prompt at a time.

Run as a script (vLLM engines need the `__main__` guard): reads a JSON job from argv[1] with
`model`, `dtype`, `max_model_len`, `completions` [[prompt, max_tokens]], `chats`
[[messages, max_tokens]], and prints one JSON line {"completions": [text...], "chats": [text...]}.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams

    llm = LLM(
        job["model"],
        dtype=job["dtype"],
        enforce_eager=True,
        max_model_len=job["max_model_len"],
        seed=0,
        block_size=job["block_size"],
    )
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n)  # noqa: E731
    completions = [llm.generate([p], greedy(n))[0].outputs[0].text for p, n in job["completions"]]
    chats = [llm.chat(m, greedy(n))[0].outputs[0].text for m, n in job["chats"]]
    print("RESULT " + json.dumps({"completions": completions, "chats": chats}), flush=True)


if __name__ == "__main__":
    main()
