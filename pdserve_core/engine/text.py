"""The text of a leg that continues tokens another engine sampled.

vLLM detokenizes each request incrementally, priming its decoder with the prompt. A decode leg's
prompt is the client's prompt plus the token(s) the prefill node already sampled and sent; when
those end halfway through a character (an emoji, a CJK character: several byte-level tokens),
the engine's decoder, primed with a prompt that ends in a partial character, cannot find a clean
place to start and emits the whole prompt's text with the first completed character.

One engine would have primed its decoder with the client's prompt alone and then decoded the
sampled tokens. `ContinuedText` does exactly that beside the engine — with vLLM's own incremental
detokenizer, so every setting (`skip_special_tokens`, `spaces_between_special_tokens`, slow
tokenizers) means what it means there — and the leg's deltas carry its text instead.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from pdserve_core.engine.types import TokenDelta


class ContinuedText:
    """The incremental text of a sequence whose `sent` tokens, after `prompt_token_ids`, were
    sampled (and their text sent) elsewhere."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], sent: list[int], params: Any
    ) -> None:
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer

        if not getattr(params, "detokenize", True):
            tokenizer = None  # the engine sends no text: nor do we
        request = SimpleNamespace(
            request_id="", prompt_token_ids=list(prompt_token_ids), sampling_params=params
        )
        self._decoder = IncrementalDetokenizer.from_new_request(tokenizer, request)
        self._decoder.update(list(sent), False)
        self._decoder.get_next_output_text(False, True)  # the other engine sent this part

    def text(self, delta: TokenDelta) -> str:
        """The text `delta`'s tokens add, as one engine would have streamed it."""
        # a sequence ended by EOS or a stop token id: vLLM leaves that token out of the text
        # (a stop string, a str stop_reason, is found in the text itself, and kept or cut there)
        by_token = delta.finish_reason == "stop" and not isinstance(delta.stop_reason, str)
        self._decoder.update(list(delta.token_ids), by_token)
        return self._decoder.get_next_output_text(delta.finish_reason is not None, True)
