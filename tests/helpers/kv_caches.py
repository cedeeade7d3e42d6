"""KV caches shaped like vLLM's on its CPU backend, for the transport tests."""

from __future__ import annotations

import torch


def cpu_caches(
    layers: int, blocks: int, heads: int, block_size: int, head_dim: int, seed: int | None
) -> dict[str, torch.Tensor]:
    """[blocks, heads, block_size, 2*head_dim] bf16 per layer: random from `seed`, or zeros
    (None)."""
    gen = torch.Generator().manual_seed(seed or 0)
    shape = (blocks, heads, block_size, 2 * head_dim)
    return {
        f"model.layers.{i}.self_attn.attn": (
            torch.randn(shape, generator=gen) if seed is not None else torch.zeros(shape)
        ).to(torch.bfloat16)
        for i in range(layers)
    }
