"""Turning a step's metadata into copy jobs: which entries move, in which batches, as which ranges.

Copies are planned as arrays (``Ranges``: one range per block per layer, never an object each),
grouped per pool and kv-cache group. Nothing here posts, waits or keeps state between steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import groupby, repeat

import numpy as np
import torch
from vllm.v1.kv_cache_interface import AttentionSpec

from ucm_ray.store.types import NO_CHECKSUM
from ucm_ray.transport.base import PoolKey, Ranges, RepeatedRanges, local_buffers
from ucm_ray.vllm.layout import GroupLayout, base_buffers, build_layouts, entry_bytes
from ucm_ray.vllm.metadata import BlockLoads, BlockSaves, LoadJob

log = logging.getLogger(__name__)

Tag = tuple[int, int]
"""Which load a copy serves: (load job id, vLLM block id)."""

Layer = tuple[int, int]
"""A layer as (kv-cache group, index in the group)."""


@dataclass
class Entries:
    """One step's entries of one kv-cache group in one pool: the vLLM block each is copied to
    or from, where the entry starts in the pool, and the load each serves (saves fail or land
    per pool: they carry no tags)."""

    block_ids: np.ndarray
    pool_offsets: np.ndarray
    tags: list[Tag]


ByPool = dict[PoolKey, dict[int, Entries]]
"""pool -> kv-cache group -> entries."""


def group_tags(entries: ByPool, group: int) -> set[Tag]:
    """The jobs ``group``'s entries serve: the same for every layer of the group, so a step
    takes them once per group, not once per layer."""
    return {tag for by_group in entries.values() if group in by_group for tag in by_group[group].tags}


def group_entries(pools: list[PoolKey], pool_of: np.ndarray, groups: np.ndarray, block_ids: np.ndarray,
                  offsets: np.ndarray, tags: list[Tag] | None = None) -> ByPool:
    """Entries given as columns (``pool_of``: index into ``pools``), split per pool and group,
    each in pool order (so a plan over every layer lists its ranges as the pool holds them).
    (The groups present by ``bincount``: ``np.unique``'s first call in a process imports
    ``numpy.ma``, which a fresh engine's first save or store hit would pay for.)"""
    out: ByPool = {}
    for index, pool in enumerate(pools):
        in_pool = pool_of == index
        for group in np.flatnonzero(np.bincount(groups[in_pool])).tolist():
            rows = np.flatnonzero(in_pool & (groups == group))
            rows = rows[np.argsort(offsets[rows], kind="stable")]
            out.setdefault(pool, {})[group] = Entries(block_ids[rows], offsets[rows],
                                                      [] if tags is None else [tags[i] for i in rows.tolist()])
    return out


Selection = tuple[BlockLoads, list[Tag], np.ndarray]
"""A load job's blocks, each block's tag, and a mask of the rows selected."""


def load_entries(selected: list[Selection]) -> ByPool:
    """The rows ``mask`` selects of each job's blocks (with its tags), per pool and group."""
    pools: dict[PoolKey, int] = {}
    columns: list[tuple[np.ndarray, ...]] = []
    tags: list[Tag] = []
    for blocks, job_tags, mask in selected:
        rows = np.flatnonzero(mask)
        locations = blocks.locations
        to_step = np.asarray([pools.setdefault(pool, len(pools)) for pool in locations.pools], dtype=np.int64)
        columns.append((to_step[locations.pool[rows]], blocks.groups[rows], blocks.block_ids[rows],
                        locations.offset[rows]))
        tags.extend(job_tags[i] for i in rows.tolist())
    if not tags:
        return {}
    pool_of, groups, block_ids, offsets = (np.concatenate(column) for column in zip(*columns))
    return group_entries(list(pools), pool_of, groups, block_ids, offsets, tags)


def save_entries(saves: BlockSaves) -> ByPool:
    """Every row (a replica of a block) of a save job, per pool and group."""
    locations = saves.locations
    return group_entries(locations.pools, locations.pool, saves.groups, saves.block_ids, locations.offset)


def split_entries(entries: ByPool, stream_ordered: Callable[[PoolKey], bool]) -> tuple[ByPool, ByPool]:
    """(stream-ordered pools' entries, the copy thread's)."""
    ordered = {pool: by_group for pool, by_group in entries.items() if stream_ordered(pool)}
    return ordered, {pool: by_group for pool, by_group in entries.items() if pool not in ordered}


@dataclass(frozen=True)
class Batch:
    """What moves in one go: these layers, in this order, of these entries. Its copies are
    planned as arrays (``KvCaches.ranges``): when the copy thread runs it, or once per step for
    stream-ordered pools."""

    layers: tuple[Layer, ...]
    entries: ByPool

    def tags(self) -> set[Tag]:
        return self.tags_in(self.entries)

    def tags_in(self, pools: Collection[PoolKey]) -> set[Tag]:
        """The jobs this batch serves through these pools."""
        groups = {group for group, _ in self.layers}
        return {tag for pool in pools for group, entries in self.entries.get(pool, {}).items() if group in groups
                for tag in entries.tags}

    def nbytes_by_pool(self, layouts: list[GroupLayout]) -> dict[PoolKey, int]:
        return {pool: sum(len(by_group[group].block_ids) * layouts[group].layers[index].block_bytes
                          for group, index in self.layers if group in by_group)
                for pool, by_group in self.entries.items()}


@dataclass(frozen=True)
class KvCaches:
    """This worker's KV caches as its copies see them, known once vLLM registers them."""

    layouts: list[GroupLayout]
    entry_sizes: np.ndarray
    """Per group: an entry's bytes (a load's size check)."""
    per_layer: np.ndarray
    """Per group: its layers get hooks (mamba / linear-attention layers get none from vLLM)."""
    buffers: tuple[torch.Tensor, ...]
    """The KV caches' allocations, as copies see them."""
    buffer_of: dict[str, int]
    """Layer name -> its index in ``buffers``."""
    device: torch.device

    def __post_init__(self) -> None:
        # their addresses and sizes read once, not at every plan's check (``LocalBuffers``)
        object.__setattr__(self, "buffers", local_buffers(self.buffers))

    @classmethod
    def unregistered(cls) -> KvCaches:
        return cls([], np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool), (), {}, torch.device("cpu"))

    @classmethod
    def build(cls, kv_caches: dict[str, torch.Tensor], kv_cache_config) -> KvCaches:
        """The caches' layout, checked against what the kv-cache spec says an entry holds."""
        groups = kv_cache_config.kv_cache_groups
        layouts = build_layouts(kv_caches, [list(group.layer_names) for group in groups], kv_cache_config.num_blocks)
        for layout in layouts:
            planned = entry_bytes(kv_cache_config, layout.group)
            if layout.layers and layout.entry_bytes != planned:
                raise ValueError(f"ucm-ray: kv-cache group {layout.group} holds {layout.entry_bytes} bytes per "
                                 f"block here but its spec says {planned}; this layout is not supported")
        hooked = [isinstance(groups[layout.group].kv_cache_spec, AttentionSpec) for layout in layouts]
        buffers = tuple(base_buffers(kv_caches))
        at = {buffer.data_ptr(): index for index, buffer in enumerate(buffers)}
        return cls(layouts, np.asarray([layout.entry_bytes for layout in layouts], dtype=np.int64),
                   np.asarray(hooked, dtype=bool), buffers,
                   {layer.name: at[layer.storage_address] for layout in layouts for layer in layout.layers},
                   next(iter(kv_caches.values())).device)

    def every_layer(self) -> tuple[Layer, ...]:
        """Every layer, group after group: one tuple, made once."""
        return self._every_layer

    @cached_property
    def _every_layer(self) -> tuple[Layer, ...]:
        return tuple((layout.group, index) for layout in self.layouts for index in range(len(layout.layers)))

    def layers_of(self, *entries: ByPool) -> list[tuple[int, int, str]]:
        """(group, index, name) of every layer of the groups these entries hold, in layer order."""
        return [(layout.group, index, layer.name) for layout in self.layouts
                if any(layout.group in by_group for some in entries for by_group in some.values())
                for index, layer in enumerate(layout.layers)]

    def saved_layers(self, entries: ByPool) -> tuple[Layer, ...]:
        """Every layer of the groups ``entries`` hold, in layer order (a save job's): where they
        hold every group that has layers (a dense model's saves), ``every_layer``'s own tuple,
        whose runs ``ranges`` made once, so a job makes no tuple per layer and ``ranges`` no
        list of them per pool (32 layers: a pass over 32 layer objects each, with the host's
        caches cold: docs/performance-log.md, stop 65)."""
        held = {group for by_group in entries.values() for group in by_group}
        if all(layout.group in held for layout in self.layouts if layout.layers):
            return self._every_layer
        return tuple((group, index) for group, index, _ in self.layers_of(entries))

    def _runs(self, layers: tuple[Layer, ...]) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """(group, its layers' indices, their buffers) of each run of one group's layers."""
        runs = [(group, tuple(index for _, index in run)) for group, run in groupby(layers, key=lambda layer: layer[0])]
        return [(group, indices, tuple(self.buffer_of[self.layouts[group].layers[i].name] for i in indices))
                for group, indices in runs]

    @cached_property
    def _every_layer_runs(self) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        return self._runs(self._every_layer)

    def ranges(self, batch: Batch, *, by_entry: bool = False) -> dict[PoolKey, Ranges]:
        """The batch's copies per pool: per layer (in the batch's order), every entry's segments,
        as arrays; each run of one group's layers in one pass (``by_entry``: the run's layers
        entry by entry, for a batch moved as one part)."""
        runs = self._every_layer_runs if batch.layers is self._every_layer else self._runs(batch.layers)
        out = {}
        for pool, by_group in batch.entries.items():
            parts = [self.layouts[group].ranges(indices, by_group[group].block_ids, by_group[group].pool_offsets,
                                                self.buffers, homes, by_entry=by_entry)
                     for group, indices, homes in runs if group in by_group]
            if parts:
                out[pool] = Ranges.concat(parts)
        return out

    def repeated_ranges(self, parts: Sequence[tuple[Layer, ...]],
                        entries: ByPool) -> dict[PoolKey, RepeatedRanges] | None:
        """The copies of ``parts`` (a layer each, of one group: a load posted layer by layer)
        per pool, as one layer's ranges repeated (``RepeatedRanges``): the arrays of one layer
        instead of every layer's. None for any other step (then ``ranges``)."""
        if not parts or any(len(part) != 1 for part in parts):
            return None
        group = parts[0][0][0]
        if any(part[0][0] != group for part in parts):
            return None
        layout, indices = self.layouts[group], [index for ((_, index),) in parts]
        homes = [self.buffer_of[layout.layers[i].name] for i in indices]
        out = {}
        for pool, by_group in entries.items():
            chosen = by_group.get(group)
            if chosen is None:
                return None
            repeated = layout.repeated_ranges(indices, chosen.block_ids, chosen.pool_offsets, self.buffers, homes)
            if repeated is None:
                return None
            out[pool] = repeated
        return out

    def segment_counts(self, entries: dict[int, Entries], parts: Sequence[tuple[Layer, ...]]) -> list[int]:
        """Per part, how many ranges one pool's entries take in it."""
        return [sum(len(entries[group].block_ids) * self.layouts[group].segment_count(index)
                    for group, index in part if group in entries) for part in parts]


@dataclass
class LoadPlan:
    """A step's loads as copy jobs. Loads that cannot wait for layer hooks (mamba states, async
    hybrid loads, chunks too short for layer hooks, non-layerwise mode, and the hit's last block,
    into whose tail vLLM writes the recomputed tokens before any hook runs) land ``at_once``
    before the forward pass; the others ``by_layer``, each layer before the layer computes."""

    tags: dict[int, list[Tag]]
    """Per load job, each of its blocks' tag (row order)."""
    unsized: set[Tag]
    """Entries whose size is not what the layout expects: not loaded."""
    checksummed: list[Tag]
    """Loaded blocks whose entry carries a checksum."""
    at_once: ByPool
    at_once_threaded: ByPool
    by_layer: ByPool
    by_layer_threaded: ByPool
    every_layer: tuple[Layer, ...]
    layers: list[tuple[int, int, str]]
    """(group, index, name) of every layer of the groups loaded by layer."""

    def batches(self) -> list[Batch]:
        """What ``start_load_kv`` moves for sure, as batches (what the byte counters add up): not
        the stream-ordered layer parts, posted from the hooks, some never (``Copier.post_through``
        counts each as it is posted)."""
        out = [Batch(((group, index),), self.by_layer_threaded) for group, index, _ in self.layers
               if self.by_layer_threaded]
        if self.at_once or self.at_once_threaded:
            out.append(Batch(self.every_layer, {**self.at_once, **self.at_once_threaded}))
        return out


def _sized_rows(blocks: BlockLoads, entry_sizes: np.ndarray) -> np.ndarray:
    """The rows whose entry has the size the layout expects (the others are logged)."""
    sized = blocks.locations.size == entry_sizes[blocks.groups]
    for row in np.flatnonzero(~sized).tolist():
        log.error("entry for block %d has %d bytes, layout expects %d: not loaded", blocks.block_ids[row],
                  blocks.locations.size[row], entry_sizes[blocks.groups[row]])
    return sized


def _by_layer_rows(job: LoadJob, sized: np.ndarray, caches: KvCaches, layerwise: bool) -> np.ndarray:
    """The rows that may wait for their layer's hook."""
    blocks = job.blocks
    if not layerwise or job.complete_in_start or job.is_async:
        return np.zeros(len(blocks), bool)
    return sized & caches.per_layer[blocks.groups] & ~blocks.before_forward


def plan_loads(loads: list[LoadJob], caches: KvCaches, *, layerwise: bool,
               stream_ordered: Callable[[PoolKey], bool]) -> LoadPlan:
    """The step's load jobs as copies: at once or by layer, on stream-ordered pools or the copy thread."""
    tags: dict[int, list[Tag]] = {}
    unsized: set[Tag] = set()
    checksummed: list[Tag] = []
    layered: list[Selection] = []
    immediate: list[Selection] = []
    for job in loads:
        blocks = job.blocks
        job_tags = tags[job.job_id] = list(zip(repeat(job.job_id), blocks.block_ids.tolist()))
        sized = _sized_rows(blocks, caches.entry_sizes)
        unsized.update(job_tags[row] for row in np.flatnonzero(~sized).tolist())
        checksummed.extend(job_tags[row]
                           for row in np.flatnonzero(sized & (blocks.locations.checksum != NO_CHECKSUM)).tolist())
        per_layer = _by_layer_rows(job, sized, caches, layerwise)
        layered.append((blocks, job_tags, per_layer))
        immediate.append((blocks, job_tags, sized & ~per_layer))
    at_once, at_once_threaded = split_entries(load_entries(immediate), stream_ordered)
    by_layer, by_layer_threaded = split_entries(load_entries(layered), stream_ordered)
    return LoadPlan(tags, unsized, checksummed, at_once, at_once_threaded, by_layer, by_layer_threaded,
                    caches.every_layer(), caches.layers_of(by_layer, by_layer_threaded))
