"""Layout derivation from real tensors of the shapes vLLM hands over (CPU tensors, same shapes)."""

import numpy as np
import pytest
import torch

from ucm_ray.vllm.layout import base_buffers, build_layouts, layer_layout

N = 6


def test_cpu_layout_one_range_per_block():
    t = torch.arange(N * 2 * 4 * 8, dtype=torch.float32).reshape(N, 2, 4, 8)  # [blocks, heads, bs, 2*hd]
    lay = layer_layout("l0", t, N)
    assert lay.block_dim == 0 and lay.block_bytes == 2 * 4 * 8 * 4
    (seg,) = lay.segments(3)
    assert torch.equal(seg, t[3].contiguous().view(torch.uint8).view(-1))


def test_gpu_layout_k_and_v_apart_is_two_ranges():
    t = torch.randn(2, N, 4, 2, 8)  # [K/V, blocks, bs, heads, hd]
    lay = layer_layout("l0", t, N)
    assert lay.block_dim == 1
    k, v = lay.segments(4)
    assert torch.equal(k, t[0, 4].contiguous().view(torch.uint8).view(-1))
    assert torch.equal(v, t[1, 4].contiguous().view(torch.uint8).view(-1))
    assert k.numel() + v.numel() == lay.block_bytes
    # the views write through: a load lands in the cache itself
    k.fill_(0)
    assert t[0, 4].abs().sum() == 0 and t[1, 4].abs().sum() > 0


def test_mamba_state_views_and_group_offsets():
    base = torch.zeros(N * 100 * 2, dtype=torch.int8)
    a, b = base[: N * 100].view(N, 1, 1, 100), base[N * 100:].view(N, 1, 1, 100)
    layouts = build_layouts({"m0": a, "m1": b}, [["m0", "m1"]], N)
    assert layouts[0].entry_bytes == 200 and layouts[0].layer_offset(1) == 100
    assert len(base_buffers({"m0": a, "m1": b})) == 1  # one allocation behind both views


def test_no_block_dimension_names_the_layer():
    with pytest.raises(ValueError, match="layer weird"):
        layer_layout("weird", torch.zeros(3, 5), N)


def test_permuted_view_of_a_dense_block_is_one_raw_range():
    """vLLM 0.26's FlashAttention hands the connector ``[blocks, heads, bs, 2*hd]`` as a
    permutation of ``[blocks, bs, heads, 2*hd]`` memory: a block is one dense range, moved in
    one copy (in memory order), not one copy per (head, K/V) piece."""
    physical = torch.randn(N, 16, 4, 2 * 8)  # [blocks, bs, heads, 2*hd] as allocated
    t = physical.permute(0, 2, 1, 3)  # the view the connector gets
    lay = layer_layout("l0", t, N)
    (seg,) = lay.segments(2)
    assert seg.numel() == lay.block_bytes == 16 * 4 * 16 * 4
    assert seg.data_ptr() == physical[2].data_ptr()
    assert torch.equal(seg, physical[2].contiguous().view(torch.uint8).view(-1))
    seg.fill_(0)  # writes through into the cache
    assert physical[2].abs().sum() == 0 and physical[1].abs().sum() > 0


def test_ranges_by_entry_are_the_same_copies_in_the_order_the_pool_holds_them():
    """A batch moved as one part lists every layer of an entry together (``by_entry``): the
    same (buffer, local, pool, size) copies as layer by layer, now in pool order when the
    entries' offsets rise, so a gather plan needs no sort."""
    caches = {f"l{i}": torch.randn(2, N, 4, 2, 8) for i in range(3)}  # K and V apart: 2 segments
    (layout,) = build_layouts(caches, [list(caches)], N)
    buffers = tuple(base_buffers(caches))
    index = [next(b for b, buf in enumerate(buffers) if buf.data_ptr() == caches[f"l{i}"].data_ptr())
             for i in range(3)]
    block_ids, offsets = np.asarray([4, 1, 3]), np.asarray([0, 1, 5]) * layout.entry_bytes
    by_layer = layout.ranges([0, 1, 2], block_ids, offsets, buffers, index)
    by_entry = layout.ranges([0, 1, 2], block_ids, offsets, buffers, index, by_entry=True)

    def copies(ranges):
        return [tuple(int(col[i]) for col in (ranges.buffer_index, ranges.local_offsets, ranges.pool_offsets,
                                              ranges.sizes)) for i in range(len(ranges))]

    assert sorted(copies(by_entry)) == sorted(copies(by_layer)) and len(by_entry) == 3 * 3 * 2
    assert by_entry.pool_offsets.tolist() == sorted(by_entry.pool_offsets.tolist())
    assert by_layer.pool_offsets.tolist() != sorted(by_layer.pool_offsets.tolist())


def test_repeated_ranges_are_the_layer_by_layer_ranges_or_none_where_layers_differ():
    """A load posted layer by layer gets one layer's ranges and each layer's shifts: made out in
    full, they are the very copies ``ranges`` lists layer by layer, in that order (for layers
    in one allocation too, a layer's bytes a shift apart). Layers whose blocks are laid out
    otherwise (here the last one's K and V side by side) get None: every layer's ranges then."""
    own = {f"l{i}": torch.randn(2, N, 4, 2, 8) for i in range(3)}  # a buffer per layer, K and V apart
    whole = torch.randn(3 * 2 * N * 4 * 2 * 8)
    shared = {f"l{i}": whole[i * 2 * N * 64: (i + 1) * 2 * N * 64].view(2, N, 4, 2, 8) for i in range(3)}
    for caches in (own, shared):
        (layout,) = build_layouts(caches, [list(caches)], N)
        buffers = tuple(base_buffers(caches))
        index = [next(b for b, buf in enumerate(buffers) if buf.data_ptr() <= caches[f"l{i}"].data_ptr()
                      < buf.data_ptr() + buf.numel()) for i in range(3)]
        block_ids, offsets = np.asarray([4, 1, 3]), np.asarray([0, 1, 5]) * layout.entry_bytes
        repeated = layout.repeated_ranges([0, 1, 2], block_ids, offsets, buffers, index)
        assert repeated is not None and len(repeated.template) == 3 * 2
        expanded, listed = repeated.expand(), layout.ranges([0, 1, 2], block_ids, offsets, buffers, index)
        for field in ("buffer_index", "local_offsets", "pool_offsets", "sizes"):
            assert getattr(expanded, field).tolist() == getattr(listed, field).tolist(), field
        assert repeated.ends() == [6, 12, 18]
    odd = {**own, "l2": torch.randn(N, 4, 2, 2 * 8)}  # same bytes a block, one segment
    (layout,) = build_layouts(odd, [list(odd)], N)
    buffers = tuple(base_buffers(odd))
    assert layout.repeated_ranges([0, 1, 2], np.asarray([1]), np.asarray([0]), buffers, [0, 1, 2]) is None
    assert layout.repeated_ranges([0, 1], np.asarray([1]), np.asarray([0]), buffers, [0, 1]) is not None


@pytest.mark.parametrize("seed", range(4))
def test_ranges_by_entry_are_the_layer_by_layer_ranges_entry_by_entry(seed):
    """``by_entry`` (one outer product per column over [blocks, layers x segments]) lists
    exactly the copies of the layer-by-layer ranges, transposed to entry order: for random
    layers (K and V apart or side by side, a buffer each or one shared), layer orders and
    blocks."""
    rng = np.random.default_rng(seed)
    for _ in range(20):
        layers, heads = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        shape = (2, N, 4, heads, 8) if rng.random() < 0.5 else (N, heads, 4, 16)
        size = int(np.prod(shape))
        if rng.random() < 0.5:
            caches = {f"l{i}": torch.randn(*shape) for i in range(layers)}
        else:
            whole = torch.randn(layers * size)
            caches = {f"l{i}": whole[i * size: (i + 1) * size].view(*shape) for i in range(layers)}
        (layout,) = build_layouts(caches, [list(caches)], N)
        buffers = tuple(base_buffers(caches))
        index = [next(b for b, buf in enumerate(buffers) if buf.data_ptr() <= caches[f"l{i}"].data_ptr()
                      < buf.data_ptr() + buf.numel()) for i in range(layers)]
        chosen = rng.permutation(layers)[: int(rng.integers(1, layers + 1))].tolist()
        count = int(rng.integers(1, N + 1))
        block_ids = rng.permutation(N)[:count].astype(np.int64)
        offsets = rng.permutation(3 * N)[:count].astype(np.int64) * layout.entry_bytes
        homes = [index[i] for i in chosen]
        by_layer = layout.ranges(chosen, block_ids, offsets, buffers, homes)
        by_entry = layout.ranges(chosen, block_ids, offsets, buffers, homes, by_entry=True)
        assert by_entry.buffers is buffers and len(by_entry) == len(by_layer)
        for field in ("buffer_index", "local_offsets", "pool_offsets", "sizes"):
            listed = getattr(by_layer, field).reshape(len(chosen), count, -1).transpose(1, 0, 2).ravel()
            assert getattr(by_entry, field).tolist() == listed.tolist(), field
