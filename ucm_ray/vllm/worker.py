"""The worker half of the connector: copies between the store and vLLM's KV cache.

Per step: ``bind`` posts the slot reservations for this step's saves (no wait);
``start_load_kv`` posts every load — one copy task per attention layer on a
copy thread, so layer L's bytes land while layers < L compute — and finishes
at once the loads that cannot wait for layer hooks (mamba states, async hybrid
loads, chunks shorter than the FULL-CUDA-graph threshold, non-layerwise mode).
``save_kv_layer`` queues a layer's copies as soon as its KV is written;
``wait_for_save`` saves what no hook covered, waits, and commits only entries
whose every layer landed. Control traffic is a few batched calls per step:
reserve and commit per shard, and a fire-and-forget release of read pins.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from vllm.v1.kv_cache_interface import AttentionSpec

from ucm_ray.config import UcmRayConfig
from ucm_ray.store.checksum import checksum
from ucm_ray.store.client import Location, ReserveFuture, StoreClient, WriteReservation
from ucm_ray.transport.base import CopyOp
from ucm_ray.vllm.layout import GroupLayout, base_buffers, build_layouts
from ucm_ray.vllm.metadata import BlockSave, RequestLoad, UcmRayConnectorMetadata
from ucm_ray.vllm.stats import UcmRayStats

log = logging.getLogger(__name__)

# (request id, vLLM block id) of a copy, so a failure maps back to what vLLM must recompute
_Tag = tuple[str, int]


@dataclass
class _LayerOps:
    """Copies of one layer (or one batch), per shard, with the blocks they serve."""

    by_shard: dict[str, list[CopyOp]] = field(default_factory=lambda: defaultdict(list))
    tags: dict[str, list[_Tag]] = field(default_factory=lambda: defaultdict(list))  # one per op
    nbytes: int = 0

    def add(self, loc: Location, offset: int, local: torch.Tensor, tag: _Tag) -> None:
        self.by_shard[loc.shard_id].append(CopyOp(loc.offset + offset, local))
        self.tags[loc.shard_id].append(tag)
        self.nbytes += local.numel()


@dataclass
class _StepState:
    loads: list[RequestLoad] = field(default_factory=list)
    load_futures: dict[str, Future] = field(default_factory=dict)  # layer -> failed tags
    load_started: float = 0.0
    failed: set[_Tag] = field(default_factory=set)
    saves: list[BlockSave] = field(default_factory=list)
    reserve: ReserveFuture | None = None
    reservation: WriteReservation | None = None
    saved_layers: set[str] = field(default_factory=set)
    save_futures: list[Future] = field(default_factory=list)
    crc: dict[_Tag, int] = field(default_factory=dict)
    """Paranoid mode: running CRC32 of each loaded block, taken right after each of its layers
    landed (layer order), before the forward pass can write into the block's tail."""


class WorkerPart:
    def __init__(self, kv_cache_config, config: UcmRayConfig, client: StoreClient, tp_rank: int) -> None:
        self._config = config
        self._client = client
        self._rank = tp_rank
        self._group_layers = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
        # Mamba / linear-attention layers get no per-layer hooks from vLLM.
        self._hooked_groups = {i for i, g in enumerate(kv_cache_config.kv_cache_groups)
                               if isinstance(g.kv_cache_spec, AttentionSpec)}
        self._num_blocks = kv_cache_config.num_blocks
        self._layouts: list[GroupLayout] = []
        self._device = torch.device("cpu")
        self._layer_of: dict[str, tuple[int, int]] = {}  # layer name -> (group, index in group)
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="ucm-ray-copy")
        self._step = _StepState()
        self._load_errors: set[int] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self.stats = UcmRayStats()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._device = next(iter(kv_caches.values())).device
        self._layouts = build_layouts(kv_caches, self._group_layers, self._num_blocks)
        self._layer_of = {layer.name: (gl.group, i) for gl in self._layouts for i, layer in enumerate(gl.layers)}
        for buf in base_buffers(kv_caches):
            self._client.register_local(buf)
        log.info("ucm-ray worker rank %d: %s", self._rank,
                 ", ".join(f"group {gl.group}: {len(gl.layers)} layers x {gl.layers[0].block_bytes if gl.layers else 0}"
                           f" B/block" for gl in self._layouts))

    # --- per step ------------------------------------------------------------------------

    def bind(self, meta: UcmRayConnectorMetadata) -> None:
        self._step = _StepState(loads=meta.loads.get(self._rank, []), saves=meta.saves.get(self._rank, []))
        if self._step.saves:
            sizes = [self._layouts[s.group].entry_bytes for s in self._step.saves]
            self._step.reserve = self._client.reserve_async([s.key for s in self._step.saves], sizes)

    def start_load_kv(self) -> None:
        st = self._step
        if not st.loads:
            return
        st.load_started = time.monotonic()
        layered: dict[str, _LayerOps] = defaultdict(_LayerOps)
        immediate = _LayerOps()
        for ld in st.loads:
            hooks = self._config.layerwise and not ld.complete_in_start and not ld.is_async
            for b in ld.blocks:
                gl = self._layouts[b.group]
                tag = (ld.req_id, b.block_id)
                if b.location.size != gl.entry_bytes:
                    log.error("entry for block %d has %d bytes, layout expects %d: not loaded",
                              b.block_id, b.location.size, gl.entry_bytes)
                    st.failed.add(tag)
                    continue
                for i, layer in enumerate(gl.layers):
                    target = layered[layer.name] if hooks and b.group in self._hooked_groups else immediate
                    self._add_block_ops(target, b.location, gl, i, b.block_id, tag)
        ready = self._compute_ready()  # e.g. vLLM zeroing fresh blocks, queued before us
        for name, ops in layered.items():
            st.load_futures[name] = self._copier.submit(self._move, ops, False, ready)
        if immediate.by_shard:
            st.failed |= self._move(immediate, False, ready)
        self.stats.add(loaded_copy_bytes=immediate.nbytes + sum(ops.nbytes for ops in layered.values()))
        if not st.load_futures:
            self._finish_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        fut = self._step.load_futures.pop(layer_name, None)
        if fut is not None:
            self._step.failed |= fut.result()
            if not self._step.load_futures:
                self._finish_loads()

    def save_kv_layer(self, layer_name: str) -> None:
        st = self._step
        if not st.saves or layer_name in st.saved_layers or layer_name not in self._layer_of:
            return
        st.saved_layers.add(layer_name)
        ops = self._save_ops(layer_name)
        if ops.by_shard:
            st.save_futures.append(self._copier.submit(self._move, ops, True, self._compute_ready()))
            self.stats.add(saved_copy_bytes=ops.nbytes)

    def wait_for_save(self) -> None:
        st = self._step
        for layer_name in list(st.load_futures):  # loads whose hook never ran
            self.wait_for_layer_load(layer_name)
        if not st.saves:
            return
        for gl in self._layouts:  # layers no hook saved: mamba states, FULL-graph replays
            for layer in gl.layers:
                self.save_kv_layer(layer.name)
        failed: set[_Tag] = set()
        for fut in st.save_futures:
            failed |= fut.result()
        res = self._reservation()
        landed = [bool(locs) and ("", i) not in failed for i, locs in enumerate(res.locations)]
        sums = [self._entry_checksum(s) if landed[i] else None for i, s in enumerate(st.saves)] \
            if self._config.checksum else None
        visible = self._client.commit(res, landed, sums)
        self.stats.add(saved_blocks=sum(visible), save_failures=sum(1 for i, locs in enumerate(res.locations)
                                                                  if locs and not landed[i]),
                       saved_bytes=sum(res.locations[i][0].size for i, v in enumerate(visible) if v))

    def transfer_results(self) -> tuple[set[str], set[str]]:
        done, failed = self._finished_recving, self._failed_recving
        self._finished_recving, self._failed_recving = set(), set()
        return done | failed, failed

    def load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        self._copier.shutdown(wait=True)
        self._client.close()

    # --- helpers -------------------------------------------------------------------------

    def _add_block_ops(self, ops: _LayerOps, loc: Location, gl: GroupLayout, layer_index: int,
                       block_id: int, tag: _Tag) -> None:
        offset = gl.layer_offset(layer_index)
        for seg in gl.layers[layer_index].segments(block_id):
            ops.add(loc, offset, seg, tag)
            offset += seg.numel()

    def _entry_checksum(self, save: BlockSave) -> int:
        """CRC32 of an entry as its bytes lie in the pool: layers in order, segments in order."""
        value = 0
        for layer in self._layouts[save.group].layers:
            for seg in layer.segments(save.block_id):
                value = checksum(seg, value)
        return value

    def _reservation(self) -> WriteReservation:
        st = self._step
        if st.reservation is None:
            assert st.reserve is not None
            st.reservation = st.reserve.result()
        return st.reservation

    def _save_ops(self, layer_name: str) -> _LayerOps:
        group, index = self._layer_of[layer_name]
        res = self._reservation()
        ops = _LayerOps()
        for i, (save, locs) in enumerate(zip(self._step.saves, res.locations)):
            if save.group != group:
                continue
            for loc in locs:  # every replica
                self._add_block_ops(ops, loc, self._layouts[group], index, save.block_id, ("", i))
        return ops

    def _compute_ready(self) -> "torch.cuda.Event | None":
        """On CUDA, an event after the work queued so far on the compute stream: a side-stream
        copy must not read a layer's KV before its attention wrote it, nor load into a block
        before vLLM's zeroing of fresh blocks ran."""
        if self._device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _move(self, ops: _LayerOps, write: bool, ready: "torch.cuda.Event | None" = None) -> set[_Tag]:
        """Run one batch per shard (all posted, then waited); returns the tags that failed."""
        # vLLM's KV caches are inference tensors; the copy thread is ours and starts on device 0.
        device = torch.cuda.device(self._device) if self._device.type == "cuda" else nullcontext()
        with torch.inference_mode(), device:
            if ready is not None:
                ready.synchronize()
            return self._move_batches(ops, write)

    def _move_batches(self, ops: _LayerOps, write: bool) -> set[_Tag]:
        failed_shards = self._client.transfer(ops.by_shard, write=write)
        if self._config.checksum and not write:
            crc = self._step.crc
            for sid, batch in ops.by_shard.items():
                if sid not in failed_shards:
                    for op, tag in zip(batch, ops.tags[sid]):
                        crc[tag] = checksum(op.local, crc.get(tag, 0))
        return {tag for sid in failed_shards for tag in ops.tags[sid]}

    def _finish_loads(self) -> None:
        """All copies of the step are in: judge them, unpin, and report what vLLM must redo."""
        st = self._step
        if time.monotonic() - st.load_started > self._config.lease_s / 2:
            log.warning("ucm-ray: loads took longer than half the read lease; treated as failed")
            st.failed |= {(ld.req_id, b.block_id) for ld in st.loads for b in ld.blocks}
        if self._config.checksum:
            for ld in st.loads:
                for b in ld.blocks:
                    tag = (ld.req_id, b.block_id)
                    if b.location.checksum is not None and tag not in st.failed \
                            and st.crc.get(tag) != b.location.checksum:
                        log.error("ucm-ray: checksum mismatch for block %d of %s (shard %s): recomputed",
                                  b.block_id, ld.req_id, b.location.shard_id)
                        self.stats.add(checksum_mismatches=1)
                        st.failed.add(tag)
        pins: dict[str, list[int]] = defaultdict(list)
        for ld in st.loads:
            for sid, ids in ld.leases.items():
                pins[sid].extend(ids)
        self._client.release_async(pins)  # one call per shard for the whole step
        for ld in st.loads:
            bad = [b.block_id for b in ld.blocks if (ld.req_id, b.block_id) in st.failed]
            if ld.is_async:
                (self._failed_recving if bad or ld.failed else self._finished_recving).add(ld.req_id)
            else:
                self._load_errors.update(bad)
            self.stats.add(loaded_blocks=len(ld.blocks) - len(bad), load_failures=len(bad))
        st.loads = []

