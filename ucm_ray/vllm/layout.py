"""Where one stored entry's bytes live in vLLM's KV cache tensors, derived, never assumed.

An entry is one block of one kv-cache group for one rank: for every layer of the
group (in group order) the block's bytes, layer-major, so a layer of many blocks
is a set of contiguous ranges (what loads and saves move). The layout
of a layer's tensor differs by backend: on CPU ``[num_blocks, heads, block, 2*head]``
(K and V side by side), on GPU often ``[2, num_blocks, ...]`` (K and V apart), for
mamba states int8 ``[num_blocks, 1, 1, state_bytes]``. We find the block dimension
by its size and split a block into the contiguous pieces that remain.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from ucm_ray.transport.base import Ranges, RepeatedRanges, as_bytes, flat_buffer


@dataclass(frozen=True)
class LayerLayout:
    name: str
    tensor: torch.Tensor
    block_dim: int
    block_bytes: int
    dense: bool = False
    """A block fills one range of memory, whatever order the view walks it in (vLLM 0.26's
    FlashAttention hands a permuted view): it is moved as that one range, in memory order.
    Engines share bytes only within one device type and attention config (the key namespace),
    so the order is the same for every reader."""
    segment_offsets: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Where block 0's segments start, in bytes from the start of the tensor's storage."""
    segment_sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    block_stride: int = 0
    """Bytes from one block's segments to the next block's: block ``b``'s segments start at
    ``segment_offsets + b * block_stride``. Copies are planned from these numbers as arrays,
    never from one tensor view per block."""

    @property
    def storage_address(self) -> int:
        return self.tensor.untyped_storage().data_ptr()

    def segments(self, block_id: int) -> list[torch.Tensor]:
        """The block's bytes in this layer as flat uint8 views (one, or one per K/V half)."""
        view = self.tensor.select(self.block_dim, block_id)
        if self.dense:
            return [as_bytes(view.as_strided((view.numel(),), (1,)))]
        pieces = [view]
        while not all(p.is_contiguous() for p in pieces):
            pieces = [q for p in pieces for q in (p.unbind(0) if not p.is_contiguous() else [p])]
        return [as_bytes(p) for p in pieces]


@dataclass(frozen=True)
class GroupLayout:
    group: int
    layers: tuple[LayerLayout, ...]

    @cached_property
    def entry_bytes(self) -> int:
        """Asked once per loaded block: summed once."""
        return sum(layer.block_bytes for layer in self.layers)

    def layer_offset(self, index: int) -> int:
        return self._layer_offsets[index]

    @cached_property
    def _layer_offsets(self) -> tuple[int, ...]:
        """Where each layer's bytes start in an entry (asked per layer per step: summed once)."""
        return tuple(int(v) for v in np.cumsum([0] + [layer.block_bytes for layer in self.layers])[:-1])

    def segment_count(self, index: int) -> int:
        return len(self.layers[index].segment_sizes)

    def ranges(self, indices: Sequence[int], block_ids: np.ndarray, entry_offsets: np.ndarray,
               buffers: tuple[torch.Tensor, ...], buffer_index: Sequence[int], *,
               by_entry: bool = False) -> Ranges:
        """Layers ``indices`` (in that order) of these blocks <-> the same layers of the entries
        starting at ``entry_offsets`` in a pool (an entry holds its layers in order, each layer's
        segments in order), layer by layer, block by block; ``by_entry``: block by block, each
        block's layers in turn (the order of the bytes in the pool when ``entry_offsets`` rise
        and ``indices`` are every layer, in order: a gather plan over every layer at once then
        needs no sort). ``buffers[buffer_index[k]]`` is layer ``indices[k]``'s storage. One
        array pass for all the layers when they have as many segments each (always, within a
        group of one backend): a step plans every layer at once."""
        indices, buffer_index = tuple(indices), tuple(buffer_index)  # (no copy of tuples)
        if by_entry:  # [blocks, layers x segments]
            flat = self._flat_shape(indices, buffer_index)
            if flat is not None:
                return self._ranges_by_entry(flat, block_ids, entry_offsets, buffers)
        shape = self._shape(indices, buffer_index)
        if shape is None:
            return Ranges.concat([self.ranges([i], block_ids, entry_offsets, buffers, [b])
                                  for i, b in zip(indices, buffer_index)])
        sizes, in_entry, strides, starts, homes = shape  # [layers, blocks, segments]
        local = block_ids[None, :, None] * strides[:, None, None] + starts[:, None, :]
        pool = entry_offsets[None, :, None] + in_entry[:, None, :]
        sizes = sizes[:, None, :]
        return Ranges(buffers, _spread(homes, local.shape), local.ravel(), pool.ravel(), _spread(sizes, local.shape))

    @staticmethod
    def _ranges_by_entry(flat: _FlatShape, block_ids: np.ndarray, entry_offsets: np.ndarray,
                         buffers: tuple[torch.Tensor, ...]) -> Ranges:
        """``ranges(..., by_entry=True)``: a row per block, a column per (layer, segment), each
        array one outer product and no other temporary (broadcasting over [blocks, layers,
        segments] ran numpy's inner loops two segments long: a 256-block 8B save's 16k ranges
        took several times the host time of the same sums over rows of 64)."""
        local = np.multiply.outer(np.asarray(block_ids, dtype=np.int64), flat.strides)
        local += flat.starts
        pool = np.add.outer(np.asarray(entry_offsets, dtype=np.int64), flat.in_entry)
        homes, sizes = flat.constant_columns(len(local))
        return Ranges(buffers, homes, local.ravel(), pool.ravel(), sizes)

    def _flat_shape(self, indices: tuple[int, ...], buffer_index: tuple[int, ...]) -> _FlatShape | None:
        """``_shape`` per (layer, segment), layer-major: each layer's block stride and buffer
        repeated for its segments, made once per layer set (None where ``_shape`` is)."""
        key = (indices, buffer_index)
        if key in self._flat_shapes:
            return self._flat_shapes[key]
        shape = self._shape(indices, buffer_index)
        flat = None
        if shape is not None:
            sizes, in_entry, strides, starts, homes = shape
            segments = sizes.shape[1]
            flat = _FlatShape(sizes.ravel(), in_entry.ravel(), np.repeat(strides, segments), starts.ravel(),
                              np.repeat(homes.ravel(), segments))
        self._flat_shapes[key] = flat
        return flat

    @cached_property
    def _flat_shapes(self) -> dict[tuple[tuple[int, ...], tuple[int, ...]], _FlatShape | None]:
        return {}

    def repeated_ranges(self, indices: Sequence[int], block_ids: np.ndarray, entry_offsets: np.ndarray,
                        buffers: tuple[torch.Tensor, ...], buffer_index: Sequence[int]) -> RepeatedRanges | None:
        """``ranges(indices, ...)`` part by part (a part per layer) as the first layer's ranges
        and each layer's shifts (``RepeatedRanges``), or None when the layers' blocks are not
        laid out alike (segments of other sizes, at other relative offsets, or another block
        stride): the first layer's arrays stand for every layer's."""
        shifts = self._shifts(tuple(indices), tuple(buffer_index))
        if shifts is None:
            return None
        template = self.ranges(indices[:1], block_ids, entry_offsets, buffers, buffer_index[:1])
        return RepeatedRanges(template, *shifts)

    def _shifts(self, indices: tuple[int, ...],
                buffer_index: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(buffer, local shift, pool shift) per layer against the first (``repeated_ranges``),
        made once per layer set; None when the layers' blocks are not laid out alike."""
        key = (indices, buffer_index)
        if key not in self._repeats:
            first = self.layers[indices[0]]
            relative = first.segment_offsets - first.segment_offsets[:1]
            alike = all(np.array_equal(layer.segment_sizes, first.segment_sizes)
                        and np.array_equal(layer.segment_offsets - layer.segment_offsets[:1], relative)
                        and layer.block_stride == first.block_stride and len(layer.segment_sizes)
                        for layer in (self.layers[i] for i in indices))
            self._repeats[key] = None if not alike else (
                np.asarray(buffer_index, dtype=np.int64),
                np.asarray([self.layers[i].segment_offsets[0] - first.segment_offsets[0] for i in indices],
                           dtype=np.int64),
                np.asarray([self.layer_offset(i) - self.layer_offset(indices[0]) for i in indices], dtype=np.int64))
        return self._repeats[key]

    @cached_property
    def _repeats(self) -> dict[tuple[tuple[int, ...], tuple[int, ...]],
                               tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
        return {}

    def _shape(self, indices: tuple[int, ...], buffer_index: tuple[int, ...]) -> _RangeShape | None:
        """What ``ranges`` needs of these layers besides the blocks, made once per layer set (a
        step asks for the same sets, once per pool); None when their segment counts differ."""
        key = (indices, buffer_index)
        if key not in self._shapes:
            layers = [self.layers[i] for i in indices]
            if len({len(layer.segment_sizes) for layer in layers}) > 1:
                self._shapes[key] = None
            else:
                sizes = np.stack([layer.segment_sizes for layer in layers])  # [layers, segments]
                firsts = np.asarray([self.layer_offset(i) for i in indices])[:, None]  # each layer's in an entry
                in_entry = firsts + np.cumsum(sizes, axis=1) - sizes
                strides = np.asarray([layer.block_stride for layer in layers], dtype=np.int64)
                starts = np.stack([layer.segment_offsets for layer in layers])
                homes = np.asarray(buffer_index, dtype=np.int64)[:, None, None]
                self._shapes[key] = (sizes, in_entry, strides, starts, homes)
        return self._shapes[key]

    @cached_property
    def _shapes(self) -> dict[tuple[tuple[int, ...], tuple[int, ...]], _RangeShape | None]:
        return {}


def _spread(values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``values`` broadcast to ``shape``, flat: filled in place, a quarter of the host time of
    ``np.broadcast_to(...).ravel()`` (a decode step's save plans a few such arrays per pool)."""
    out: np.ndarray = np.empty(shape, dtype=np.int64)
    out[...] = values
    return out.ravel()


_RangeShape = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""Per layer: segment sizes, offsets in an entry, block stride, segment offsets in a block,
buffer index (see ``GroupLayout.ranges``)."""

KEPT_COLUMN_BLOCKS = 32
"""Entries up to which ``_FlatShape.constant_columns`` keeps the columns it made, per count: a
decode step's save has a few entries a pool, and the same counts come back step after step."""


@dataclass(frozen=True)
class _FlatShape:
    """``_RangeShape`` per (layer, segment), layer-major (each layer's block stride and buffer
    repeated for its segments), and the columns that are the same for every entry."""

    sizes: np.ndarray
    in_entry: np.ndarray
    strides: np.ndarray
    starts: np.ndarray
    homes: np.ndarray
    kept: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    """Entries -> ``constant_columns`` for that many, read-only."""

    def constant_columns(self, entries: int) -> tuple[np.ndarray, np.ndarray]:
        """(buffer index, size) of each range of ``entries`` entries, entry by entry: made once
        per count up to ``KEPT_COLUMN_BLOCKS`` and shared read-only (no array may be written in
        place after it is planned), so a decode step's save allocates and fills two arrays
        fewer per pool (with the host's caches cold each numpy call costs ~10 us:
        docs/performance-log.md, stop 65)."""
        columns = self.kept.get(entries)
        if columns is None:
            shape = (entries, len(self.sizes))
            columns = (_spread(self.homes, shape), _spread(self.sizes, shape))
            if entries <= KEPT_COLUMN_BLOCKS:
                for column in columns:
                    column.flags.writeable = False
                self.kept[entries] = columns
        return columns


def layer_layout(name: str, tensor: torch.Tensor, num_blocks: int) -> LayerLayout:
    dims = [d for d, size in enumerate(tensor.shape) if size == num_blocks]
    if not dims:
        raise ValueError(f"KV cache tensor of layer {name} has shape {tuple(tensor.shape)}; "
                         f"no dimension matches num_blocks={num_blocks}")
    dim = dims[0]
    block = tensor.select(dim, 0)
    layout = LayerLayout(name, tensor, dim, block.numel() * tensor.element_size(), _fills_one_range(block))
    base = tensor.untyped_storage().data_ptr()
    first = layout.segments(0)
    offsets = np.asarray([seg.data_ptr() - base for seg in first], dtype=np.int64)
    sizes = np.asarray([seg.numel() for seg in first], dtype=np.int64)
    stride = tensor.stride(dim) * tensor.element_size()
    if num_blocks > 1 and [seg.data_ptr() - base for seg in layout.segments(num_blocks - 1)] != list(
            offsets + (num_blocks - 1) * stride):
        raise ValueError(f"KV cache tensor of layer {name}: blocks are not evenly spaced in memory")
    return LayerLayout(name, tensor, dim, layout.block_bytes, layout.dense, offsets, sizes, stride)


def _fills_one_range(view: torch.Tensor) -> bool:
    """Whether ``view``'s elements are exactly ``numel`` consecutive ones of its storage: its
    strides, smallest first, are the running products of the sizes (a permuted contiguous
    tensor)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(view.shape, view.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def build_layouts(kv_caches: dict[str, torch.Tensor], group_layers: list[list[str]],
                  num_blocks: int) -> list[GroupLayout]:
    """Per kv-cache group, its layers present on this worker (pipeline stages hold a subset)."""
    return [GroupLayout(g, tuple(layer_layout(n, kv_caches[n], num_blocks) for n in names if n in kv_caches))
            for g, names in enumerate(group_layers)]


def base_buffers(kv_caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The distinct allocations behind the layer views, each as one flat uint8 tensor:
    transports register these once instead of one region per layer."""
    seen: dict[tuple[str, int], torch.Tensor] = {}
    for t in kv_caches.values():
        key = (str(t.device), t.untyped_storage().data_ptr())
        if key not in seen:
            seen[key] = flat_buffer(t)
    return list(seen.values())


def entry_bytes(kv_cache_config, group: int) -> int:
    """Bytes of one stored entry of ``group`` (every layer's block), from the kv-cache spec:
    the scheduler plans slots with it before any worker exists; workers check their real
    layout against it at start-up. A state (mamba) page is padded to the attention page size;
    only the state itself is stored."""
    spec_group = kv_cache_config.kv_cache_groups[group]
    spec = spec_group.kv_cache_spec
    shapes = getattr(spec, "shapes", None)
    if shapes is not None:  # MambaSpec
        per_layer = sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, spec.dtypes))
    else:
        per_layer = spec.page_size_bytes
    return per_layer * len(spec_group.layer_names)
