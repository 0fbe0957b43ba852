"""Moving a batch of ``Ranges`` between this process's registered tensors and one remote pool.

A transport validates the whole batch first (nothing moves if any op is wrong) and posts it
as one NIXL request per local memory type; Ray never carries these bytes.

* On one host UCX picks ``cma`` (process_vm_readv/writev, zero-copy): the copy runs
  synchronously inside the post call (it releases the GIL), so a same-node "async" transfer
  is already done when ``read``/``write`` return. Between nodes (TCP/RDMA) it is genuinely
  asynchronous; ``wait`` polls too.
* Prepped descriptor lists (``prep_xfer_dlist`` + ``make_prepped_xfer``) select whole
  descriptors by index, so arbitrary byte ranges (odd sizes, unaligned offsets) do not map
  onto them; page-granular lists would work for aligned ops only and would cost one
  descriptor per page of the pool, for a small saving per batch. So each batch uses
  ``initialize_xfer`` with descriptor lists built from plain tuples.
* Where the worker's memory is staged (``staging``: GPU KV on a host without RDMA), a batch
  goes through a pinned host slab the worker copies itself, and NIXL moves host memory only.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable
from itertools import repeat
from typing import Any

import torch

from ucm_ray.transport.base import (
    CompletedTransfer,
    PoolDescriptor,
    PoolTransport,
    Ranges,
    Transfer,
    TransferError,
)
from ucm_ray.transport.nixl.agent import memory_of
from ucm_ray.transport.nixl.client import NixlClientAgent, Region, client_agent
from ucm_ray.transport.nixl.staging import HostStaging

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
"""What ``Transfer.wait(None)`` waits at most: a cache must never hang a step forever."""


class _NixlTransfer(Transfer):
    """One or two posted NIXL requests (one per local memory type) for one batch.

    Handles are released as soon as each request's outcome is known, on success and on
    failure, so neither UCX requests nor memory pins leak; never while a request is in
    flight: NIXL takes that release as a cancel, which UCX cannot do for a read or write
    (``ucp_request_cancel`` cancels receives only), so the request would still land later,
    unseen. A timed-out transfer keeps its requests until they are over (``late``).
    """

    def __init__(self, agent: Any, what: tuple[str, int, str], default_timeout_s: float | None,
                 over: Callable[[_NixlTransfer], None]) -> None:
        """``over``: called once no request of this transfer is in flight any more, if one was."""
        self._agent = agent
        self._what = what
        self._default_timeout_s = default_timeout_s
        self._over = over
        self._pending: list[Any] = []
        self._error: str | None = None
        self._lock = threading.Lock()

    def _add(self, handle: Any, state: str) -> None:
        if state == "DONE":
            self._release(handle)
        elif state == "PROC":
            self._pending.append(handle)
        else:
            self._release(handle)
            self._fail("NIXL rejected the post")

    def _fail(self, why: str) -> None:
        if self._error is None:
            op_name, n_ops, shard = self._what  # formatted only on failure: posting stays cheap
            self._error = f"NIXL {op_name} of {n_ops} ops with shard {shard}: {why}"
            log.warning("%s", self._error)

    def _release(self, handle: Any) -> None:
        try:
            handle.release()
        except Exception as e:  # noqa: BLE001 -- could not cancel an in-flight request; NIXL frees it later
            self._fail(f"releasing the request failed ({e})")

    def _poll(self) -> bool:
        """Progress and collect finished requests; True when none is pending. Caller holds the lock."""
        still = []
        for h in self._pending:
            try:
                state = self._agent.check_xfer_state(h)
            except Exception as e:  # noqa: BLE001 -- any failure to read a request's state fails it
                state = "ERR"
                self._fail(str(e))
            if state == "PROC":
                still.append(h)
            else:
                if state != "DONE":
                    self._fail("NIXL reported an error")
                self._release(h)
        if self._pending and not still:
            self._over(self)
        self._pending = still
        return not still

    def done(self) -> bool:
        with self._lock:
            return self._poll()

    def late(self) -> bool:
        return not self.done()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every request finished; ``None`` means the transport's default timeout.

        Raises TransferError on failure or timeout. On timeout the requests in flight are
        kept, not released: the destination's bytes are garbage, and until ``late`` is False
        may still change (``done`` polls them and releases each one that is over).
        """
        if timeout_s is None:
            timeout_s = self._default_timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        spins = 0
        while True:
            with self._lock:  # held per poll only, so done() from another thread stays cheap
                if self._poll():
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    self._fail(f"timed out after {timeout_s} s")
                    break
            spins += 1
            # Spin briefly (completions are usually near), then back off to <= 1 ms.
            time.sleep(0 if spins < 64 else min(1e-3, 1e-5 * (spins - 63)))
        if self._error is not None:
            raise TransferError(self._error)


class NixlPoolTransport(PoolTransport):
    """Moves bytes between this process's registered tensors and one remote shard pool.

    ``read``/``write`` validate the whole batch first (nothing moves if any op
    is wrong), then post it as one NIXL request per local memory type.
    """

    name = "nixl"

    def __init__(self, desc: PoolDescriptor, agent: NixlClientAgent | None = None, *,
                 default_timeout_s: float | None = DEFAULT_TIMEOUT_S, staging: HostStaging | None = None) -> None:
        """``staging``: the worker's host staging, through which batches of the memory it
        applies to go (None: NIXL moves every batch's memory itself)."""
        if not desc.nixl_metadata or not desc.nixl_agent:
            raise ValueError(f"shard {desc.shard_id} publishes no NIXL agent (was it started "
                             "with transport='shm'?)")
        if desc.pool_bytes <= 0 or desc.pool_base_addr <= 0:
            raise ValueError(f"shard {desc.shard_id}: bad pool descriptor "
                             f"(bytes={desc.pool_bytes}, base=0x{desc.pool_base_addr:x})")
        self._client = agent if agent is not None else client_agent()
        self.desc = desc
        self.default_timeout_s = default_timeout_s
        self._staging = staging
        self._remote = self._client.add_remote(desc.nixl_metadata, desc.nixl_agent)
        self._regions: dict[tuple[str, int, int, int], Region] = {}
        self._starts: dict[tuple[str, int], list[int]] = {}  # sorted region starts per memory
        self._ends: dict[tuple[str, int], list[int]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._in_flight: set[_NixlTransfer] = set()
        """Transfers with a request in flight: ``close`` leaves the remote agent and registrations
        to the last of them (``_transfer_over``)."""
        log.debug("NIXL transport to shard %s (agent %s, %d bytes)", desc.shard_id, self._remote,
                  desc.pool_bytes)

    # -- registration ------------------------------------------------------------------

    def register_local(self, tensor: torch.Tensor) -> None:
        """Register the storage under ``tensor`` with NIXL (idempotent per storage); memory
        whose batches are staged both ways is not (NIXL never touches it; where only its reads
        are, its writes still move it)."""
        if not self._stages(tensor.device, write=True):
            self._register(tensor)

    def deregister_local(self, tensor: torch.Tensor) -> None:
        """Undo ``register_local``: the caller is about to free memory no transfer can still
        land in (a timed-out read's buffer once it is no longer ``late``)."""
        if not self._stages(tensor.device, write=True):
            self._deregister(tensor)

    def _register(self, tensor: torch.Tensor) -> None:
        mem_type, dev = memory_of(tensor)
        storage = tensor.untyped_storage()
        key = (mem_type, dev, storage.data_ptr(), storage.nbytes())
        with self._lock:
            self._check_open()
            if key in self._regions:
                return
            self._regions[key] = self._client.acquire_region(tensor)
            self._reindex()

    def _deregister(self, tensor: torch.Tensor) -> None:
        """Undo ``_register`` of ``tensor``'s storage (nothing if this transport never registered
        it, or closed): host staging drops a slab no transfer uses."""
        mem_type, dev = memory_of(tensor)
        storage = tensor.untyped_storage()
        with self._lock:
            region = self._regions.pop((mem_type, dev, storage.data_ptr(), storage.nbytes()), None)
            if region is not None:
                self._reindex()
        if region is not None:
            self._client.release_region(region)

    def _reindex(self) -> None:
        by_mem: dict[tuple[str, int], list[Region]] = {}
        for r in self._regions.values():
            by_mem.setdefault((r.mem_type, r.dev), []).append(r)
        self._starts, self._ends = {}, {}
        for mem, rs in by_mem.items():
            rs.sort(key=lambda r: r.start)
            self._starts[mem] = [r.start for r in rs]
            self._ends[mem] = [r.end for r in rs]

    # -- data movement -----------------------------------------------------------------

    def read(self, ranges: Ranges) -> Transfer:
        staged = len(ranges) > 0 and self._stages(ranges.device, write=False)
        return self._staged("READ", ranges) if staged else self._post("READ", ranges)

    def write(self, ranges: Ranges) -> Transfer:
        staged = len(ranges) > 0 and self._stages(ranges.device, write=True)
        return self._staged("WRITE", ranges) if staged else self._post("WRITE", ranges)

    def _stages(self, device: torch.device, *, write: bool) -> bool:
        return self._staging is not None and self._staging.applies(device, write=write)

    def _staged(self, op_name: str, ranges: Ranges) -> Transfer:
        """``ranges`` through a staging slab; checked against the pool first (nothing moves
        if any op is wrong, the gather into the slab included)."""
        assert self._staging is not None
        with self._lock:
            self._check_open()
        ranges.check(self.desc.pool_bytes, f"{op_name}: shard {self.desc.shard_id}'s pool")
        return self._staging.post(ranges, to_pool=op_name == "WRITE", post=lambda slab: self._post(op_name, slab),
                                  register=self._register, deregister=self._deregister)

    def _check_ops(self, op_name: str, ranges: Ranges) -> dict[tuple[str, int], tuple[list, list]]:
        """NIXL descriptor rows (local, remote) per local memory; ValueError on any bad range
        (nothing moves then). Each local buffer is checked once, not each range.

        Rows are plain tuples: NIXL builds a descriptor list from them several times faster
        than from a numpy array.
        """
        ranges.check(self.desc.pool_bytes, f"{op_name}: shard {self.desc.shard_id}'s pool")
        groups: dict[tuple[str, int], tuple[list, list]] = {}
        for home, buffer in enumerate(ranges.buffers):
            mine = (ranges.buffer_index == home) & (ranges.sizes > 0)
            if not mine.any():
                continue
            mem = memory_of(buffer)
            addr, n = buffer.data_ptr(), buffer.numel()
            starts = self._starts.get(mem)
            j = bisect.bisect_right(starts, addr) - 1 if starts else -1
            if (j < 0 or addr + n > self._ends[mem][j]) and not self._covered(mem, addr, n):
                raise ValueError(f"{op_name}: local buffer {mem[0]}:{mem[1]} [0x{addr:x}, +{n}) is "
                                 "not inside memory registered with register_local()")
            sizes = ranges.sizes[mine].tolist()
            rows = groups.setdefault(mem, ([], []))
            rows[0].extend(zip((addr + ranges.local_offsets[mine]).tolist(), sizes, repeat(mem[1])))
            rows[1].extend(zip((self.desc.pool_base_addr + ranges.pool_offsets[mine]).tolist(), sizes, repeat(0)))
        return groups

    def _covered(self, mem: tuple[str, int], addr: int, n: int) -> bool:
        """Slow path for overlapping registrations (bisect only looks at the nearest start)."""
        return any(r.start <= addr and addr + n <= r.end for r in self._regions.values()
                   if (r.mem_type, r.dev) == mem)

    def _post(self, op_name: str, ranges: Ranges) -> Transfer:
        with self._lock:
            self._check_open()
            groups = self._check_ops(op_name, ranges)
        if not groups:
            return CompletedTransfer()
        agent = self._client.agent
        xfer = _NixlTransfer(agent, (op_name, len(ranges), self.desc.shard_id), self.default_timeout_s,
                             self._transfer_over)
        for (mem_type, _dev), (local, remote) in groups.items():
            try:
                handle = agent.initialize_xfer(op_name, agent.get_xfer_descs(local, mem_type),
                                               agent.get_xfer_descs(remote, "DRAM"), self._remote)
            except Exception as e:  # noqa: BLE001 -- the transfer fails with the reason, never the copy thread
                xfer._fail(f"could not create the request ({type(e).__name__}: {e})")
                break
            try:
                state = agent.transfer(handle)
            except Exception as e:  # noqa: BLE001 -- e.g. the shard died: nixlRemoteDisconnectError
                xfer._release(handle)
                xfer._fail(f"could not post ({type(e).__name__}: {e})")
                break
            xfer._add(handle, state)
        if xfer._pending:
            with self._lock:
                self._in_flight.add(xfer)
        return xfer

    # -- teardown ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NIXL transport to shard {self.desc.shard_id} is closed")
        if self._client.closed:
            raise RuntimeError(f"NIXL client agent {self._client.name} is closed")

    def close(self) -> None:
        """Drop our references to the remote agent and our registrations: now, or once no
        transfer of this transport has a request in flight.

        NIXL 1.5.1 reports a request whose remote agent was removed as over ("invalidated"),
        while UCX still lands it: a read that timed out on a paused shard, whose pool the
        membership then dropped, read as no longer ``late`` and landed later in memory the fence,
        ``StoreClient.get`` or a staging slab had handed on (review67, stop 67). Its transfer
        stays late until it is over; the last one over finishes the close.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._in_flight:
                log.info("NIXL transport to shard %s closed with %d transfers in flight: kept until they are over",
                         self.desc.shard_id, len(self._in_flight))
                return
        self._release_remote()

    def _transfer_over(self, transfer: _NixlTransfer) -> None:
        with self._lock:
            if transfer not in self._in_flight:
                return
            self._in_flight.discard(transfer)
            last = self._closed and not self._in_flight
        if last:
            self._release_remote()

    def _release_remote(self) -> None:
        with self._lock:
            regions, self._regions = list(self._regions.values()), {}
            self._starts, self._ends = {}, {}
        self._client.remove_remote(self._remote)
        for r in regions:
            self._client.release_region(r)
