"""A prompt's KV blocks named alike in every process, and the log a node keeps of the blocks its
engine holds — so that every router, not only the one that sent a request, knows where it left
its blocks (prefix-aware routing, router/decides/prefixes.py).

A block is named by a chained hash: of its tokens and of the name of the block before it, the
first block's parent being the request's cache salt. So a name matches only the same block at the
same place after the same prefix and salt, as vLLM names its own. The chain starts from a digest
of the salt (Python's `hash` of a string differs between processes) and goes on with `hash` of
integer tuples, which every process computes alike.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Sequence

UNSALTED = 0x7064736572766531
"""The chain's root for a prompt without a cache salt."""

LOG_ENTRIES = 1024
"""Requests a node's log keeps: a router that falls further behind (or starts) learns these."""


def root(salt: str | None) -> int:
    """The parent of a prompt's first block: its cache salt's, the same in every process."""
    if not salt:
        return UNSALTED
    # any str a client can send, a lone surrogate from a JSON escape included
    data = salt.encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(data, digest_size=8, person=b"pdserve-salt").digest()
    return int.from_bytes(digest, "big")


def block_hashes(
    token_ids: Sequence[int], block_size: int, salt: str | None = None, prior: Sequence[int] = ()
) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`; `prior`: the hashes of its first blocks,
    already known."""
    hashes = list(prior)
    parent = hashes[-1] if hashes else root(salt)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


class BlockLog:
    """The blocks a node's engine was left holding, request by request, numbered so that each
    router asks only for what it has not seen (`since`)."""

    def __init__(self, keep: int = LOG_ENTRIES) -> None:
        self._entries: deque[tuple[int, list[int]]] = deque(maxlen=keep)
        self._next = 0

    def add(self, hashes: list[int]) -> None:
        if hashes:
            self._entries.append((self._next, hashes))
            self._next += 1

    def clear(self) -> None:
        """The engine is gone: it holds none of them (the numbers go on)."""
        self._entries.clear()

    def since(self, seen: int) -> tuple[int, list[list[int]]]:
        """(the number to ask from next time, the entries numbered `seen` or later still kept)."""
        return self._next, [hashes for number, hashes in self._entries if number >= seen]
