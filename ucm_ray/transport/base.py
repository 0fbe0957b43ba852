"""The small interface every data path implements.

A shard owns one preallocated byte pool. A client moves bytes between its own
tensors (CPU or CUDA) and byte ranges of that pool. Ray never carries these
bytes: the control plane hands out pool offsets, the transport copies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

PoolKey = tuple[str, int]
"""(shard id, incarnation): one start of one shard's pool (the same alias as ``store.blockstore``)."""


class TransferError(RuntimeError):
    """A transfer failed or timed out; its destination bytes must not be trusted."""


@dataclass(frozen=True)
class CopyOp:
    """One contiguous byte range: ``pool[pool_offset : pool_offset + local.nbytes]`` <-> ``local``.

    ``local`` is a contiguous uint8 tensor (a view into a buffer the client
    registered with the transport beforehand).
    """

    pool_offset: int
    local: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.local.numel()


@dataclass(frozen=True)
class PoolDescriptor:
    """What a client needs to reach one shard's pool, as published by the shard.

    ``shm_path`` is set when the pool is a shared-memory file on the shard's node;
    ``nixl_metadata`` when the shard registered the pool with a NIXL agent.
    ``incarnation`` is random per shard start: a shard restarted under the same id has
    a new, empty pool, and ``(shard_id, incarnation)`` tells the two apart so no client
    keeps using the old mapping (0 only for stand-alone pools outside a fleet).
    """

    shard_id: str
    node_id: str
    pool_bytes: int
    shm_path: str | None
    nixl_agent: str | None
    nixl_metadata: bytes | None
    pool_base_addr: int
    incarnation: int = 0

    @property
    def key(self) -> PoolKey:
        return (self.shard_id, self.incarnation)


class Transfer(ABC):
    """A posted batch of copies; ``wait`` raises ``TransferError`` on failure."""

    @abstractmethod
    def done(self) -> bool: ...

    @abstractmethod
    def wait(self, timeout_s: float | None = None) -> None: ...


class CompletedTransfer(Transfer):
    """A transfer that finished (or failed) while it was posted, e.g. CPU memcpy."""

    def __init__(self, error: BaseException | None = None) -> None:
        self._error = error

    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float | None = None) -> None:
        if self._error is not None:
            raise TransferError(str(self._error)) from self._error


class PoolTransport(ABC):
    """Moves bytes between a client's registered tensors and one shard pool."""

    name: str

    @abstractmethod
    def register_local(self, tensor: torch.Tensor) -> None:
        """Make ``tensor``'s memory usable as ``CopyOp.local`` (once, at start-up)."""

    @abstractmethod
    def read(self, ops: Sequence[CopyOp]) -> Transfer:
        """Post pool -> local copies."""

    @abstractmethod
    def write(self, ops: Sequence[CopyOp]) -> Transfer:
        """Post local -> pool copies."""

    @abstractmethod
    def close(self) -> None: ...


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    if not t.is_contiguous():
        raise ValueError("transfer buffers must be contiguous")
    return t.view(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.view(-1)
