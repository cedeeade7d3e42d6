"""NCCL under the collective plane (collective.py): GPU caches, a two-rank NCCL communicator per
producer/consumer pair. This is all that is NCCL-only; pairing, ordering, deadlines and abort are
the collective plane's, and run in CI on the gloo backend (gloo.py).

- a pair id is an ncclUniqueId (128 bytes), made by the consumer;
- joining is `ncclCommInitRank(2, id, rank)`, which has no deadline of its own: it runs in a
  helper thread and the join fails at the caller's deadline (the thread ends when NCCL does);
- a transfer is one NCCL group of sends (or receives), one per run, on the current CUDA stream;
  its completion is a CUDA event polled under the pull's deadline (NCCL operations never time
  out, and a peer that died would leave them waiting forever);
- abort is `ncclCommAbort`.
Only imported when `transport: nccl` is chosen; needs CUDA caches and libnccl (through vLLM's
NCCL wrapper).
"""

from __future__ import annotations

from typing import Any

from pdserve_core.kv.transport.collective import Backend, CollectivePlane, call_before, wait_until


class NcclBackend(Backend):
    id_bytes = 128

    def __init__(self, library: Any, device: Any = None) -> None:
        self.library = library
        """vLLM's NCCLLibrary (or a test double with the same calls)."""
        self.device = device

    def new_id(self, local_host: str) -> bytes:
        return bytes(self.library.ncclGetUniqueId().internal)

    def join(self, pair_id: bytes, rank: int, local_host: str, deadline: float) -> Any:
        unique_id = self.library.unique_id_from_bytes(pair_id)
        return call_before(
            deadline, lambda: self.library.ncclCommInitRank(2, unique_id, rank), "NCCL join"
        )

    def move(self, comm: Any, runs: list[Any], peer_rank: int, send: bool, deadline: float):
        import torch

        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device)
            self.library.ncclGroupStart()
            op = self.library.ncclSend if send else self.library.ncclRecv
            for flat in runs:
                op(flat.data_ptr(), flat.numel(), 0, peer_rank, comm, stream.cuda_stream)
            self.library.ncclGroupEnd()
            finished = torch.cuda.Event()
            finished.record(stream)
            wait_until(finished.query, deadline)

    def abort(self, comm: Any) -> None:
        self.library.ncclCommAbort(comm)


class NcclPlane(CollectivePlane):
    name = "nccl"

    def make_backend(self) -> Backend:
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

        if self.layers and self.layers[0].device.type != "cuda":
            raise ValueError("the nccl KV transport needs CUDA KV caches; use transport: tcp")
        return NcclBackend(NCCLLibrary(), self.layers[0].device if self.layers else None)
