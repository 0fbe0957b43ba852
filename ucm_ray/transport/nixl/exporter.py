"""The shard side: a pool registered once with the shard's own NIXL agent, reached one-sidedly.

The shard publishes its agent's metadata through the control plane (the ``PoolDescriptor``)
and does no per-transfer work: its UCX progress thread handles wire-up.
"""

from __future__ import annotations

import logging

import torch

from ucm_ray.transport.base import PoolDescriptor
from ucm_ray.transport.nixl.agent import NixlUnavailableError, make_agent

log = logging.getLogger(__name__)


class NixlPoolExporter:
    """Makes one shard's pool readable/writable by remote NIXL agents.

    Lives in the shard process for the life of the pool. Registers the pool
    once; clients then reach it one-sidedly with the published metadata, so the
    shard does no per-transfer work (its UCX progress thread handles wire-up).
    """

    def __init__(self, pool: torch.Tensor, agent_name: str, *, bind_ip: str | None = None,
                 index: torch.Tensor | None = None) -> None:
        """``index``: the shard's published index, registered too, so readers on other nodes
        can look keys up and validate their copies one-sidedly (``store.engine.remote_index``)."""
        if pool.device.type != "cpu":
            # PoolDescriptor carries no memory type / device for the pool yet.
            raise ValueError("NixlPoolExporter: only host-memory (cpu) pools are supported")
        if not pool.is_contiguous() or pool.numel() == 0:
            raise ValueError("NixlPoolExporter: the pool must be a non-empty contiguous tensor")
        self._pool: torch.Tensor | None = pool
        self._agent = make_agent(agent_name, bind_ip)
        self.agent_name = agent_name
        self.base_addr = pool.data_ptr()
        self.pool_bytes = pool.numel() * pool.element_size()
        self._index = index
        self.index_base_addr = index.data_ptr() if index is not None else 0
        self.index_bytes = index.numel() * index.element_size() if index is not None else 0
        regions = [(self.base_addr, self.pool_bytes, 0, "")]
        if index is not None:
            regions.append((self.index_base_addr, self.index_bytes, 0, ""))
        try:
            self._reg = self._agent.register_memory(regions, "DRAM")
        except Exception as e:
            raise NixlUnavailableError(f"NIXL could not register the {self.pool_bytes}-byte pool: {e}") from e
        self._metadata: bytes = self._agent.get_agent_metadata()
        log.info("NIXL agent %s exports %d bytes at 0x%x (metadata %d B)", agent_name,
                 self.pool_bytes, self.base_addr, len(self._metadata))

    def metadata(self) -> bytes:
        """What a client passes to ``add_remote_agent`` (taken once the pool is registered)."""
        if self._pool is None:
            raise RuntimeError(f"NixlPoolExporter {self.agent_name} is closed")
        return self._metadata

    def descriptor(self, shard_id: str, node_id: str, shm_path: str | None = None, *,
                   incarnation: int = 0) -> PoolDescriptor:
        """The PoolDescriptor clients need to reach this pool."""
        return PoolDescriptor(shard_id=shard_id, node_id=node_id, pool_bytes=self.pool_bytes,
                              shm_path=shm_path, nixl_agent=self.agent_name,
                              nixl_metadata=self.metadata(), pool_base_addr=self.base_addr,
                              incarnation=incarnation)

    def close(self) -> None:
        """Deregister the pool and drop the agent and our reference to the pool tensor.

        Dropping the tensor matters: the owner's ``mmap.close()`` refuses while views live.
        Close clients first; a client that still holds our metadata gets errors, not bytes.
        """
        if self._pool is None:
            return
        try:
            self._agent.deregister_memory(self._reg)
        except Exception:
            log.warning("NIXL agent %s: deregistering the pool failed", self.agent_name, exc_info=True)
        self._reg = None
        self._agent = None  # joins the progress thread, closes UCX
        self._pool = None
        self._index = None
        log.info("NIXL agent %s closed", self.agent_name)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- never raise from a finalizer
            pass
