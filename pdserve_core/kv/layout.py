"""What a worker's paged KV cache looks like, and whether two workers can swap raw blocks.

Blocks move as opaque bytes (never token slices: on CPU a block's K rows are stored transposed),
so both sides must agree on every field of `KVLayout` before a byte moves.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


class LayoutError(ValueError):
    """A KV cache this connector cannot ship as whole blocks."""


@dataclass(frozen=True)
class KVLayout:
    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str
    """Device type and per-layer shape after the block dimension, e.g. "cpu:[3, 128, 128]"."""
    block_bytes: int
    """Bytes of one block of one layer."""
    tp_size: int
    tp_rank: int
    transport: str


def describe(
    kv_caches: dict[str, Any],
    model: str,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    tp_rank: int,
    tp_size: int,
    transport: str,
) -> KVLayout:
    """Layout of the caches vLLM registered (`{layer_name: [blocks, ...] tensor}`)."""
    if not kv_caches:
        raise LayoutError("no KV cache layers were registered")
    first = next(iter(kv_caches.values()))
    shapes = {tuple(t.shape) for t in kv_caches.values()}
    dtypes = {str(t.dtype) for t in kv_caches.values()}
    if len(shapes) != 1 or len(dtypes) != 1:
        raise LayoutError(f"layers differ in shape or dtype: {shapes} {dtypes}")
    for name, tensor in kv_caches.items():
        if not tensor[0].is_contiguous() or tensor.stride(0) != tensor[0].numel():
            raise LayoutError(f"layer {name}: a block is not one contiguous run of memory")
    return KVLayout(
        model=model,
        dtype=str(first.dtype).removeprefix("torch."),
        block_size=block_size,
        num_layers=len(kv_caches),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        layout=f"{first.device.type}:{list(first.shape[1:])}",
        block_bytes=first[0].numel() * first.element_size(),
        tp_size=tp_size,
        tp_rank=tp_rank,
        transport=transport,
    )


def mismatch(ours: KVLayout, theirs: KVLayout) -> str | None:
    """The first field that differs, said plainly; None when the layouts agree."""
    for field in fields(KVLayout):
        mine, other = getattr(ours, field.name), getattr(theirs, field.name)
        if mine != other:
            return f"KV layout mismatch: {field.name} is {mine!r} here but {other!r} on the peer"
    return None
