"""The client side's one NIXL agent per process, shared by every remote pool it reaches.

One agent per process keeps UCX workers, memory registrations and connections shared:
registering a KV cache once serves every shard. Registrations and remote agents are
reference-counted so that transports can be opened and closed independently.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from ucm_ray.transport.base import TransferError
from ucm_ray.transport.nixl.agent import make_agent, memory_of

log = logging.getLogger(__name__)


@dataclass
class Region:
    """One registered local memory range, shared by the transports that registered it."""

    start: int
    nbytes: int
    mem_type: str
    dev: int
    reg: Any
    keep: Any  # the storage: keeps the memory alive while NIXL may touch it
    refs: int = 0

    @property
    def end(self) -> int:
        return self.start + self.nbytes


@dataclass
class _Remote:
    name: str
    metadata: bytes
    refs: int = 0


class NixlClientAgent:
    """The one NIXL agent a client process uses for every remote pool.

    One agent per process keeps UCX workers, memory registrations and
    connections shared: registering a KV cache once serves every shard.
    Registrations and remote agents are reference-counted so that transports
    can be opened and closed independently.
    """

    def __init__(self, name: str | None = None, *, bind_ip: str | None = None) -> None:
        self.name = name or f"ucmr-client-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.agent = make_agent(self.name, bind_ip)
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._regions: dict[tuple[str, int, int, int], Region] = {}
        self._remotes: dict[str, _Remote] = {}
        self._closed = False
        log.info("NIXL client agent %s started", self.name)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- local memory ------------------------------------------------------------------

    def acquire_region(self, tensor: torch.Tensor) -> Region:
        """Register the whole storage under ``tensor`` (once per storage) and take a reference."""
        mem_type, dev = memory_of(tensor)
        storage = tensor.untyped_storage()
        start, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            raise ValueError("register_local: empty tensor")
        key = (mem_type, dev, start, nbytes)
        with self._lock:
            self._check_open()
            region = self._regions.get(key)
            if region is None:
                try:
                    reg = self.agent.register_memory([(start, nbytes, dev, "")], mem_type)
                except Exception as e:
                    raise TransferError(f"NIXL could not register {nbytes} bytes of {mem_type}: {e}") from e
                region = Region(start, nbytes, mem_type, dev, reg, storage)
                self._regions[key] = region
                log.debug("NIXL %s: registered %s:%d [0x%x, +%d)", self.name, mem_type, dev, start, nbytes)
            region.refs += 1
            return region

    def release_region(self, region: Region) -> None:
        with self._lock:
            region.refs -= 1
            key = (region.mem_type, region.dev, region.start, region.nbytes)
            if region.refs <= 0 and self._regions.get(key) is region:
                del self._regions[key]
                self._deregister(region)

    def _deregister(self, region: Region) -> None:
        try:
            self.agent.deregister_memory(region.reg)
        except Exception:
            log.warning("NIXL %s: deregister failed", self.name, exc_info=True)

    # -- remote agents -----------------------------------------------------------------

    def add_remote(self, metadata: bytes, expected_name: str | None) -> str:
        """Load a shard's metadata (once per agent name) and take a reference to it."""
        with self._lock:
            self._check_open()
            known = self._remotes.get(expected_name) if expected_name is not None else None
            if known is not None and known.metadata == metadata:
                known.refs += 1
                return known.name
            if known is not None:  # same name, new metadata: a restarted shard; drop the stale one
                try:
                    self.agent.remove_remote_agent(known.name)
                except Exception:
                    log.debug("NIXL %s: invalidating stale %s failed", self.name, known.name, exc_info=True)
            try:
                raw = self.agent.add_remote_agent(metadata)
            except Exception as e:
                raise TransferError(f"NIXL could not load metadata of agent {expected_name!r}: {e}") from e
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            if expected_name is not None and name != expected_name:
                raise ValueError(f"NIXL metadata is for agent {name!r}, descriptor says {expected_name!r}")
            remote = self._remotes.get(name)
            if remote is None or remote.metadata != metadata:  # new, or a restarted shard
                remote = _Remote(name, metadata, (remote.refs if remote else 0))
                self._remotes[name] = remote
            remote.refs += 1
            return name

    def remove_remote(self, name: str) -> None:
        with self._lock:
            remote = self._remotes.get(name)
            if remote is None:
                return
            remote.refs -= 1
            if remote.refs <= 0:
                del self._remotes[name]
                try:
                    self.agent.remove_remote_agent(name)
                except Exception:  # noqa: BLE001 -- closing goes on for the others
                    log.warning("NIXL %s: removing remote agent %s failed", self.name, name, exc_info=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NIXL client agent {self.name} is closed")

    def close(self) -> None:
        """Forget all remotes and registrations (transports using this agent stop working)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for name in list(self._remotes):
                try:
                    self.agent.remove_remote_agent(name)
                except Exception:  # noqa: BLE001 -- closing goes on for the others
                    pass
            self._remotes.clear()
            for region in self._regions.values():
                self._deregister(region)
            self._regions.clear()
            self.agent = None
        log.info("NIXL client agent %s closed", self.name)


_client_lock = threading.Lock()
_client: NixlClientAgent | None = None
_inherited: list[NixlClientAgent] = []
"""Agents inherited through fork: never destroyed in the child (their progress threads do
not exist here, and tearing down the parent's UCX state from a child is unsafe)."""


def client_agent() -> NixlClientAgent:
    """This process's shared client agent, created on first use (thread-safe, fork-aware)."""
    global _client
    with _client_lock:
        if _client is not None and _client.pid != os.getpid():
            _inherited.append(_client)  # after fork the parent's UCX state is unusable
            _client = None
        if _client is None or _client.closed:
            _client = NixlClientAgent()
        return _client


def shutdown_client_agent() -> None:
    """Close the shared client agent (tests, process exit); the next use starts a new one."""
    global _client
    with _client_lock:
        if _client is not None and _client.pid == os.getpid():
            _client.close()
        _client = None
