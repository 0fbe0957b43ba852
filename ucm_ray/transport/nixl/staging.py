"""Pinned host staging of NIXL transfers: the worker copies its KV to and from host memory itself.

Without an RDMA port, UCX moves a NIXL transfer's GPU memory with CUDA copies of its own, and
those waited for the work on the legacy default stream, where vLLM runs its forward: a step
whose save had a part for another node's pool ended after its forward (0.303 s instead of
0.030 s, H100 host, stop 64). Staged, NIXL moves host memory only. A save's rows are gathered
into a staging slab (page-locked, registered with NIXL as DRAM) on a CUDA stream of ours, which
never waits for the default stream; the copy thread waits for that stream's event, then posts
the NIXL write from the slab. A load's NIXL read lands in a slab, and once it landed its bytes
are scattered into the KV on our stream before ``wait`` returns, so the layer that reads them is
queued after. The copies between the KV and a slab are those of a same-node pool
(``shm.HostBufferTransport``: one gather plan on CUDA, plain copies on CPU).

Slabs are made on demand, kept and reused (a transfer holds one from its post until its outcome
is known), each a power of two from ``MIN_SLAB_BYTES``, all together at most ``MAX_STAGING_BYTES``;
a batch that no free slab fits and no room is left for drops free slabs (deregistered from NIXL)
to make its own: kept, small slabs would fail every larger batch for good once they filled the bound.
A batch that finds no room takes back the slabs of transfers that are over and whose bytes
nobody still has to take out of them (saves, failed or abandoned loads), and waits for the
others' (the layers of a large load, read ahead of their hooks, come back as the hooks take
them) at most ``ROOM_WAIT_S``; then it fails like a transfer that could not start.

A batch larger than half the bound (a load at once of >13k tokens of a 70B model is 4 GiB) goes
in pieces of half the bound, one after another through one slab at a time, as one ``Transfer``
(``_PiecewiseTransfer``): a single slab for it might never fit, and two such batches fit side by
side. A failure of staging itself (no room, a slab not allocated) is a ``LocalTransferError``:
the batch's blocks fail, its pool is not made suspect.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ucm_ray.transport.base import CompletedTransfer, LocalTransferError, Ranges, Transfer, TransferError
from ucm_ray.transport.nixl.agent import rdma_ports
from ucm_ray.transport.shm import HostBufferTransport

log = logging.getLogger(__name__)

SETTINGS = ("auto", "on", "off")
MIN_SLAB_BYTES = 1 << 20
MAX_STAGING_BYTES = 4 << 30
"""Staging one worker may hold at most: a prompt's save of 16k tokens of an 8B model (2 GiB)
and a load beside it. A batch larger than half of it goes in pieces of half of it."""
ROOM_WAIT_S = 1.0
"""How long a batch waits at most for other transfers' slabs to come back: a hook takes a
layer's bytes within milliseconds of the layers before it; a batch still without room after
this is failed rather than holding up the copy thread's queue."""


class StagingFull(LocalTransferError):
    """No slab that fits came back in time and there is no room for a new one."""


def stages_through_host(setting: str, device: torch.device, rdma: Sequence[str], *, write: bool) -> bool:
    """Whether NIXL writes (``write``) or reads of ``device`` memory go through host staging.
    ``auto``: on a host without an RDMA port (``rdma``: ``agent.rdma_ports()``), a GPU's memory
    both ways (UCX's own CUDA copies wait for the legacy default stream) and host memory's reads:
    such a read needs the shard's process (UCX over TCP), so one from a shard that pauses stays
    in flight past its timeout, and NIXL cannot cancel it; staged, it lands in a quarantined slab,
    where unstaged it would land in KV blocks vLLM reuses, and the worker stops instead
    (``LateReadError``; a CPU engine's death, ``tests/e2e/test_late_read_engine.py``). Host
    memory's writes stay unstaged (a late write is reported, its slots quarantined: staging would
    only add a copy). With an RDMA port nothing: the NIC reaches the memory itself (GPUDirect
    RDMA), without the shard's process. ``on`` stages any memory both ways (CPU too: the same
    path, tested on a box without a GPU), ``off`` none."""
    if setting not in SETTINGS:
        raise ValueError(f"nixl_stage_through_host {setting!r} is not one of {' | '.join(SETTINGS)}")
    if setting == "auto":
        return not rdma and (device.type == "cuda" or not write)
    return setting == "on"


@dataclass(frozen=True)
class StagingLayout:
    """A batch's ranges laid out in a slab: range i at ``offsets[i]``, packed in pool order (so a
    gather plan finds entries side by side as one stretch); ``runs``: (slab offset, pool offset,
    bytes) of the ranges adjacent in the pool merged, one NIXL descriptor each."""

    offsets: np.ndarray
    nbytes: int
    runs: tuple[np.ndarray, np.ndarray, np.ndarray]

    @classmethod
    def of(cls, ranges: Ranges) -> StagingLayout:
        sizes, pool = ranges.sizes, ranges.pool_offsets
        order = None if bool((pool[1:] >= pool[:-1]).all()) else np.argsort(pool, kind="stable")
        if order is not None:
            sizes, pool = sizes[order], pool[order]
        at = np.cumsum(sizes) - sizes
        offsets = at if order is None else np.empty_like(at)
        if order is not None:
            offsets[order] = at
        first = np.flatnonzero(np.concatenate([[True], pool[1:] != pool[:-1] + sizes[:-1]]))
        return cls(offsets, int(sizes.sum()), (at[first], pool[first], np.add.reduceat(sizes, first)))


@dataclass(eq=False)
class _Slab:
    tensor: torch.Tensor
    copies: HostBufferTransport
    holder: _StagedTransfer | None = None
    busy: bool = True
    deregisters: set[Callable[[torch.Tensor], None]] = field(default_factory=set)
    """Of the transports that registered it with NIXL: called before it is dropped."""


@dataclass(eq=False)
class _Lease:
    """A slab held by one transfer from its post until its outcome is known."""

    staging: HostStaging
    slab: _Slab
    released: bool = field(default=False)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.staging.give_back(self.slab)


class _StagedTransfer(Transfer):
    """A NIXL transfer of a slab. Once its outcome is known (landed, failed) the slab is given
    back, a read's bytes scattered from it into the batch's buffers first (waited for on our
    stream, never the default one). A read that failed scatters nothing: its blocks keep what
    they held. One that timed out with its NIXL request still in flight (NIXL cannot cancel it:
    it lands whenever the shard answers) keeps its slab, quarantined, until the request is over
    (``reclaim``): given back at once, another batch's bytes in it could be overwritten by the
    late ones before that batch scattered them (docs/performance-log.md, stop 66)."""

    def __init__(self, inner: Transfer, lease: _Lease, scatter: Callable[[], None] | None) -> None:
        self._inner = inner
        self._lease = lease
        self._scatter = scatter
        self._writes = scatter is None
        self._error: BaseException | None = None
        self._over = False
        self._abandoned = False
        self._lock = threading.Lock()

    def _settle(self, timeout_s: float | None) -> None:
        if self._over:
            return
        try:
            self._inner.wait(timeout_s)
            if self._scatter is not None:
                self._scatter()
        except Exception as e:  # noqa: BLE001 -- kept, raised by every wait
            self._error = e
        finally:
            self._over = True
            if self._error is None or not self._inner.late():
                self._lease.release()
            else:
                self._lease.staging.quarantined_one(self._lease.slab)

    def late(self) -> bool:
        """A write's NIXL request in flight may still land in the pool; a read's never reaches
        its destination after a failure (its slab is quarantined instead)."""
        return self._writes and self._inner.late()

    @property
    def quarantined(self) -> bool:
        """Over, but its slab kept: its NIXL request may still write into it."""
        return self._over and not self._lease.released

    def done(self) -> bool:
        with self._lock:
            if not self._over and self._inner.done():
                self._settle(0.0)
            return self._over

    def abandon(self) -> None:
        with self._lock:
            self._scatter = None
            self._abandoned = True
        self._inner.abandon()

    def reclaim(self) -> None:
        """Give the slab back if the transfer is over and no bytes wait in it for a ``wait``
        (a save; a load that failed or was abandoned), nor can still land in it (a quarantined
        one's request is over): a slab is needed, and its owner may never look again (an
        abandoned or quarantined transfer's never does)."""
        with self._lock:
            if self._over:
                if not self._lease.released and not self._inner.late():
                    self._lease.release()  # quarantine over: its request can no longer land
                return
            if not self._inner.done():
                return
            if self._scatter is not None:
                try:
                    self._inner.wait(0.0)
                    return  # landed: its consumer's ``wait`` scatters it
                except Exception:  # noqa: BLE001 -- failed: nothing to scatter, ``wait`` raises it
                    self._scatter = None
            self._settle(0.0)

    def wait(self, timeout_s: float | None = None) -> None:
        with self._lock:
            self._settle(timeout_s)
        if self._error is not None:
            raise _failure(self._error)
        if self._abandoned:
            raise TransferError("staged NIXL transfer: abandoned, nothing delivered")


def pieces(ranges: Ranges, layout: StagingLayout, piece_bytes: int) -> list[Ranges]:
    """``ranges`` cut into batches of at most ``piece_bytes`` each, consecutive stretches of
    ``layout`` (pool order); a range across a cut is cut too. Zero-byte ranges are left out."""
    starts = layout.offsets
    ends = starts + ranges.sizes
    out = []
    for begin in range(0, layout.nbytes, piece_bytes):
        end = begin + piece_bytes
        mine = np.flatnonzero((starts < end) & (ends > begin) & (ranges.sizes > 0))
        first, last = np.maximum(starts[mine], begin), np.minimum(ends[mine], end)
        skip = first - starts[mine]
        out.append(Ranges(ranges.buffers, ranges.buffer_index[mine], ranges.local_offsets[mine] + skip,
                          ranges.pool_offsets[mine] + skip, last - first))
    return out


def _failure(error: BaseException) -> TransferError:
    """What ``wait`` raises for a staged transfer that failed with ``error`` (a staging failure
    stays local: no pool is to blame for it)."""
    kind = LocalTransferError if isinstance(error, LocalTransferError) else TransferError
    failure = kind(f"staged NIXL transfer: {error}")
    failure.__cause__ = error
    return failure


class _PiecewiseTransfer(Transfer):
    """A batch moved in pieces, each a ``_StagedTransfer`` posted once the one before is over
    (its bytes scattered, its slab given back): by ``wait``, or by ``done`` as it polls. To its
    caller one transfer: done once every piece is over or one failed (no later piece is posted
    then; a load's earlier pieces were scattered into blocks that are failed with the batch),
    ``abandon`` abandons the piece in flight and posts none after it."""

    def __init__(self, first: Transfer, rest: list[Ranges],
                 post_piece: Callable[[Ranges, float], _StagedTransfer]) -> None:
        self._current: Transfer | None = first
        self._rest = rest
        self._post_piece = post_piece
        self._error: BaseException | None = None
        self._abandoned = False
        self._failed_piece: Transfer | None = None
        self._lock = threading.Lock()

    def late(self) -> bool:
        return self._failed_piece is not None and self._failed_piece.late()

    def _post_next(self, wait_s: float) -> None:
        """Post the next piece (a slab waited for at most ``wait_s``); StagingFull passes through
        when ``wait_s`` is 0 (``done`` tries again at its next poll), any other error fails the batch."""
        try:
            self._current = self._post_piece(self._rest[0], wait_s)
        except StagingFull as e:
            if not wait_s:
                raise
            self._error = e
        except Exception as e:  # noqa: BLE001 -- kept, raised by every wait
            self._error = e
        del self._rest[0]

    def _land_current(self, timeout_s: float | None) -> None:
        assert self._current is not None
        try:
            self._current.wait(timeout_s)
        except TransferError as e:
            self._error = e
            self._failed_piece = self._current
        self._current = None

    def done(self) -> bool:
        with self._lock:
            while self._error is None and not self._abandoned:
                if self._current is None:
                    if not self._rest:
                        return True
                    try:
                        self._post_next(0.0)
                    except StagingFull:
                        return False
                elif self._current.done():
                    self._land_current(0.0)
                else:
                    return False
            return self._current is None or self._current.done()

    def wait(self, timeout_s: float | None = None) -> None:
        """Until every piece is over (an abandoned one's in flight too: its slab comes back)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while self._current is not None or (self._rest and self._error is None):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if self._current is not None:
                    self._land_current(left)
                elif left == 0.0:
                    self._error = TransferError(f"timed out after {timeout_s} s, {len(self._rest)} pieces not posted")
                else:
                    self._post_next(ROOM_WAIT_S if left is None else min(ROOM_WAIT_S, left))
        if self._abandoned:
            raise TransferError("staged NIXL transfer: abandoned, nothing delivered")
        if isinstance(self._error, TransferError):  # a piece's, or staging's own: as it is
            raise self._error
        if self._error is not None:
            raise _failure(self._error)

    def abandon(self) -> None:
        with self._lock:  # held: no ``done`` may scatter the piece in flight meanwhile
            self._abandoned = True
            self._rest = []
            if self._current is not None:
                self._current.abandon()


class HostStaging:
    """One worker's staging slabs, shared by its NIXL transports (thread-safe)."""

    def __init__(self, setting: str = "auto", *, max_bytes: int | None = None,
                 rdma: Sequence[str] | None = None) -> None:
        """``max_bytes``: the bound (None: ``MAX_STAGING_BYTES`` as it is now)."""
        stages_through_host(setting, torch.device("cpu"), (), write=True)  # a bad setting fails here, not at a copy
        self.setting = setting
        self._max_bytes = MAX_STAGING_BYTES if max_bytes is None else max_bytes
        self._rdma = rdma
        self._applies: dict[tuple[str, bool], bool] = {}
        self._slabs: list[_Slab] = []
        self._lock = threading.Lock()
        self.allocations = 0
        """Slabs made so far (a worker's steady state makes none)."""
        self.quarantines = 0
        """Slabs quarantined so far: kept by a transfer that timed out with its NIXL request in
        flight, until the request was over."""

    def applies(self, device: torch.device, *, write: bool) -> bool:
        """Whether NIXL writes (``write``) or reads of ``device`` memory are staged here (decided
        once per kind and direction)."""
        known = self._applies.get((device.type, write))
        if known is None:
            if self._rdma is None:
                self._rdma = rdma_ports()
            known = self._applies[device.type, write] = stages_through_host(self.setting, device, self._rdma,
                                                                            write=write)
        return known

    @property
    def held_bytes(self) -> int:
        """Bytes of slabs held by transfers whose outcome is not known yet."""
        with self._lock:
            return sum(slab.tensor.numel() for slab in self._slabs if slab.busy)

    @property
    def quarantined(self) -> int:
        """Slabs quarantined now (``quarantines``): they count against the bound, so a shard that
        never answers can hold at most the bound, and this worker's staged batches fail, not
        blamed on their pools, while it does."""
        with self._lock:
            return sum(1 for slab in self._slabs if slab.holder is not None and slab.holder.quarantined)

    def quarantined_one(self, slab: _Slab) -> None:
        with self._lock:
            self.quarantines += 1
        log.warning("NIXL staging: a %d-byte slab quarantined: its timed-out read may still land in it",
                    slab.tensor.numel())

    def reclaim(self) -> None:
        """Take back the slabs of transfers that are over (``_StagedTransfer.reclaim``)."""
        with self._lock:
            holders = [slab.holder for slab in self._slabs if slab.busy and slab.holder is not None]
        for holder in holders:
            holder.reclaim()

    @property
    def slab_addresses(self) -> list[int]:
        with self._lock:
            return [slab.tensor.data_ptr() for slab in self._slabs]

    def post(self, ranges: Ranges, *, to_pool: bool, post: Callable[[Ranges], Transfer],
             register: Callable[[torch.Tensor], None], deregister: Callable[[torch.Tensor], None]) -> Transfer:
        """``ranges`` (the batch's buffers <-> the pool, checked by the caller) through a slab, or
        slab after slab in pieces of half the bound: ``post`` moves a slab's ranges with the pool
        (registered by ``register`` first; ``deregister`` undoes that where the slab is dropped).
        A save's (first) piece is gathered into its slab before it returns (on CUDA: on our
        stream, waited for here, on the copy thread). A staging failure is not raised: the
        transfer returned fails with it (``LocalTransferError``), as a pool's failure would."""
        layout = StagingLayout.of(ranges)
        if not layout.nbytes:
            return CompletedTransfer()

        def post_piece(piece: Ranges, wait_s: float) -> _StagedTransfer:
            return self._post_piece(piece, StagingLayout.of(piece), to_pool, post, register, deregister, wait_s)

        piece_bytes = max(1, self._max_bytes // 2)
        try:
            if layout.nbytes <= piece_bytes:
                return self._post_piece(ranges, layout, to_pool, post, register, deregister, ROOM_WAIT_S)
            first, *rest = pieces(ranges, layout, piece_bytes)
            log.debug("NIXL staging: a %d-byte batch in %d pieces", layout.nbytes, 1 + len(rest))
            return _PiecewiseTransfer(post_piece(first, ROOM_WAIT_S), rest, post_piece)
        except LocalTransferError as e:  # logged where it is waited for, as a pool's failure is
            return CompletedTransfer(e)

    def _post_piece(self, ranges: Ranges, layout: StagingLayout, to_pool: bool, post: Callable[[Ranges], Transfer],
                    register: Callable[[torch.Tensor], None], deregister: Callable[[torch.Tensor], None],
                    wait_s: float) -> _StagedTransfer:
        """``post`` of a batch that one slab holds (waited for at most ``wait_s``)."""
        lease = _Lease(self, self._take(layout.nbytes, wait_s))
        copies = lease.slab.copies
        local = Ranges(ranges.buffers, ranges.buffer_index, ranges.local_offsets, layout.offsets, ranges.sizes)
        slab_at, pool_at, sizes = layout.runs
        remote = Ranges((lease.slab.tensor,), np.zeros(len(sizes), dtype=np.int64), slab_at, pool_at, sizes)
        try:
            register(lease.slab.tensor)
            with self._lock:  # (the slab is busy: nothing drops it meanwhile)
                lease.slab.deregisters.add(deregister)
            if to_pool:
                with torch.inference_mode():  # vLLM's KV caches are inference tensors
                    copies.copy(local, to_pool=True, follow_caller=False).wait()
            inner = post(remote)
        except BaseException:
            lease.release()
            raise

        def scatter() -> None:  # on the thread that waits (the engine's, outside inference mode)
            with torch.inference_mode():
                copies.copy(local, to_pool=False, follow_caller=False).wait()

        transfer = _StagedTransfer(inner, lease, None if to_pool else scatter)
        with self._lock:
            if not lease.released:
                lease.slab.holder = transfer
        return transfer

    def _take(self, nbytes: int, wait_s: float) -> _Slab:
        """A slab of at least ``nbytes``: a free one, a new one within the bound, or one given
        back within ``wait_s`` (StagingFull after that)."""
        deadline = time.monotonic() + wait_s
        spins = 0
        while True:
            slab = self._free_or_new(nbytes)
            if slab is not None:
                return slab
            self.reclaim()
            with self._lock:
                freed = any(not slab.busy and slab.tensor.numel() >= nbytes for slab in self._slabs)
            if freed:
                continue  # a slab that fits came back
            if time.monotonic() >= deadline:
                raise StagingFull(f"NIXL staging is full: {nbytes} bytes asked, no slab that fits came "
                                    f"back within {wait_s} s and no room for a new one (at most "
                                    f"{self._max_bytes} bytes)")
            spins += 1
            time.sleep(0 if spins < 64 else min(1e-3, 1e-5 * (spins - 63)))

    def _free_or_new(self, nbytes: int) -> _Slab | None:
        """The smallest free slab of at least ``nbytes``, else a new one within the bound (free
        slabs, all too small, dropped for room, largest first), else None."""
        dropped: list[_Slab] = []
        with self._lock:
            free = [slab for slab in self._slabs if not slab.busy and slab.tensor.numel() >= nbytes]
            if free:
                slab = min(free, key=lambda s: s.tensor.numel())
                slab.busy = True
                return slab
            made = sum(slab.tensor.numel() for slab in self._slabs)
            idle = sorted((slab for slab in self._slabs if not slab.busy), key=lambda s: -s.tensor.numel())
            room = self._max_bytes - made  # without drops; with every idle slab dropped:
            most = room + sum(slab.tensor.numel() for slab in idle)
            rounded = max(MIN_SLAB_BYTES, 1 << (nbytes - 1).bit_length())
            size = next((n for n in (rounded, nbytes) if n <= room), rounded if rounded <= most else nbytes)
            if size > most:
                return None
            while made + size > self._max_bytes:
                dropped.append(idle.pop(0))
                made -= dropped[-1].tensor.numel()
            self._slabs = [slab for slab in self._slabs if all(slab is not d for d in dropped)]
            try:
                tensor = torch.empty(size, dtype=torch.uint8)
                slab = _Slab(tensor, HostBufferTransport(tensor, "NIXL staging"))
            except Exception as e:  # noqa: BLE001 -- host memory this process could not have or pin
                failed: BaseException | None = e
            else:
                failed = None
                self._slabs.append(slab)
                self.allocations += 1
        for old in dropped:  # free: no transfer uses it (NIXL holds its memory until deregistered)
            self._drop(old)
        if failed is not None:
            raise LocalTransferError(f"NIXL staging: a {size}-byte slab could not be made "
                                     f"({type(failed).__name__}: {failed})") from failed
        log.debug("NIXL staging: a %d-byte slab (%d made, %d dropped for it)", size, made + size, len(dropped))
        return slab

    @staticmethod
    def _drop(slab: _Slab) -> None:
        for deregister in slab.deregisters:
            deregister(slab.tensor)
        slab.copies.close()

    def give_back(self, slab: _Slab) -> None:
        with self._lock:
            slab.busy = False
            slab.holder = None

    def close(self) -> None:
        """Unpin and drop every slab (after the transports that registered them closed), but
        keep the memory of those still lent (``_LENT_AT_CLOSE``)."""
        with self._lock:
            slabs, self._slabs = self._slabs, []
        lent = [slab for slab in slabs if slab.busy]
        for slab in slabs:
            slab.copies.close()
        if lent:
            log.warning("NIXL staging: %d slab(s), %d bytes, still lent at close (a read timed out in flight?): "
                        "kept for this process's life, not freed", len(lent), sum(slab.tensor.numel() for slab in lent))
            with _LENT_LOCK:
                _LENT_AT_CLOSE.extend(lent)


_LENT_AT_CLOSE: list[_Slab] = []
"""Slabs a closed ``HostStaging`` had still lent (quarantined by a read that timed out in
flight, held by a transfer whose outcome is unknown): NIXL may still land a request in one, so
its memory is kept, never freed. Freed, the allocator handed it to the next tensor of its size,
and the late read landed there (``tests/integration/test_store_client_late_transfers.py``).
Never freed rather than freed once over: nothing polls a closed client's transfers (a closed
transport keeps its remote agent until they are over, ``NixlPoolTransport.close``)."""
_LENT_LOCK = threading.Lock()
