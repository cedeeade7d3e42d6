"""Which prompt prefixes each node holds in its prefix cache, as the router knows it.

An engine with prefix caching keeps the KV of every full block it computed or loaded until it
needs the block for something else; a prompt that starts with those blocks skips them. The
router cannot see inside the engines, so it keeps an approximation from what it sent where:
- a prompt run on a node (whole, as a prefill, or loaded by a decode leg) leaves its full
  blocks there;
- a request that ran to its end on a node also leaves the full blocks of its prompt followed by
  its output (the next turn of a conversation sends them back as its history);
- a node holds at most its engine's KV blocks (`NodeInfo.num_blocks`): past that, the blocks
  the router recorded least recently are taken to be evicted, as the engine's own LRU would;
- a node whose engine was rebuilt holds nothing (its `NodeInfo` changed).
A block is named by a hash of its tokens and of every token before it (and the request's cache
salt), so a hash matches only the same block at the same place after the same prefix — the
chaining vLLM's own prefix cache uses (pdserve_core/engine/blocks.py: the same in every process).
With several routers each also learns what the others sent: every node logs the blocks its
requests left (`BlockLog`) and each router reads the log with its health checks, once a second
(`record_blocks`). The error of the approximation is bounded the safe way:
an engine whose blocks were taken by other work computes the tokens again (the request is
correct, only slower); what the router never recorded it does not count.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from pdserve_core.engine.blocks import block_hashes

DEFAULT_BLOCKS = 4096
"""Blocks assumed for a node whose engine did not report its KV capacity."""


class Prefix:
    """A prompt's chained block hashes, per block size (nodes may differ), computed once."""

    def __init__(self, token_ids: Sequence[int], salt: str | None = None) -> None:
        self.token_ids = token_ids
        self.salt = salt
        self._hashes: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def hashes(self, block_size: int) -> list[int]:
        """One hash per full block of the prompt."""
        if block_size not in self._hashes:
            self._hashes[block_size] = block_hashes(self.token_ids, block_size, self.salt)
        return self._hashes[block_size]

    def extended(self, token_ids: Sequence[int]) -> Prefix:
        """This prompt followed by `token_ids` (a request's output), its hashes continued from
        this prompt's rather than computed again."""
        longer = Prefix(list(self.token_ids) + list(token_ids), self.salt)
        for size, hashes in self._hashes.items():
            longer._hashes[size] = block_hashes(longer.token_ids, size, self.salt, hashes)
        return longer


class NodePrefixes:
    """The blocks one node is taken to hold, least recently recorded first."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._info: Any = None
        """The `NodeInfo` of the engine these blocks are in: another one holds none of them."""

    def _current(self, info: Any) -> OrderedDict[int, None]:
        if info is not self._info:
            self._blocks.clear()
            self._info = info
        return self._blocks

    @staticmethod
    def _block_size(info: Any) -> int:
        return getattr(info, "block_size", 0) or 16

    def cached_tokens(self, info: Any, prefix: Prefix) -> int:
        """Tokens at the start of `prefix` this node is taken to hold (whole blocks)."""
        blocks, size = self._current(info), self._block_size(info)
        hits = 0
        for block in prefix.hashes(size):
            if block not in blocks:
                break
            hits += 1
        # an engine computes a prompt's last token even when all of it is cached (it needs its
        # logits): as vLLM does, a whole-prompt hit stops a block short
        return min(hits * size, (len(prefix) - 1) // size * size)

    def record(self, info: Any, prefix: Prefix) -> None:
        """The node now holds `prefix`'s full blocks (the most recently used)."""
        self.record_blocks(info, prefix.hashes(self._block_size(info)))

    def record_blocks(self, info: Any, hashes: Iterable[int]) -> None:
        """The node holds these blocks (named in its own log), the most recently used."""
        blocks = self._current(info)
        for block in hashes:
            blocks[block] = None
            blocks.move_to_end(block)
        capacity = getattr(info, "num_blocks", 0) or DEFAULT_BLOCKS
        while len(blocks) > capacity:
            blocks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._blocks)
