"""When NIXL transfers are staged through host memory, and how a batch is laid out in a slab
(``transport.nixl.staging``; the transfers themselves: ``tests/integration/test_nixl_staging.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ucm_ray.config import ConfigError, UcmRayConfig
from ucm_ray.transport.base import Ranges
from ucm_ray.transport.nixl.staging import HostStaging, StagingLayout, pieces, stages_through_host

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.mark.parametrize(("setting", "device", "rdma", "reads", "writes"), [
    ("auto", CUDA, [], True, True),  # UCX's own CUDA copies would wait for the legacy default stream
    ("auto", CUDA, ["mlx5_0:1"], False, False),  # GPUDirect RDMA reaches the GPU memory itself
    # over TCP a read needs the shard's process: one from a paused shard lands late, in a slab
    # (unstaged, in KV vLLM reuses: the worker stopped); a late write is reported instead
    ("auto", CPU, [], True, False),
    ("auto", CPU, ["mlx5_0:1"], False, False),
    ("on", CPU, ["mlx5_0:1"], True, True),
    ("on", CUDA, ["mlx5_0:1"], True, True),
    ("off", CUDA, [], False, False),
    ("off", CPU, [], False, False),
])
def test_auto_stages_gpu_memory_and_host_memory_s_reads_on_a_host_without_rdma(setting, device, rdma, reads,
                                                                                writes):
    for write, staged in ((False, reads), (True, writes)):
        assert stages_through_host(setting, device, rdma, write=write) is staged
        assert HostStaging(setting, rdma=rdma).applies(device, write=write) is staged


def test_a_bad_setting_is_refused_where_it_is_given():
    with pytest.raises(ValueError, match="auto | on | off"):
        HostStaging("yes")
    with pytest.raises(ConfigError) as e:
        UcmRayConfig(nixl_stage_through_host="always")
    assert str(e.value).startswith("nixl_stage_through_host: 'always' is not allowed")
    assert len(str(e.value).splitlines()) == 1


def test_yaml_on_and_off_mean_the_settings():
    assert UcmRayConfig().nixl_stage_through_host == "auto"
    assert UcmRayConfig.from_dict({"nixl_stage_through_host": False}).nixl_stage_through_host == "off"
    assert UcmRayConfig.from_dict({"nixl_stage_through_host": True}).nixl_stage_through_host == "on"


def _ranges(pool: list[int], sizes: list[int]) -> Ranges:
    buffer = torch.zeros(1 << 16, dtype=torch.uint8)
    n = len(sizes)
    return Ranges((buffer,), np.zeros(n, dtype=np.int64), np.arange(n, dtype=np.int64) * 1000,
                  np.asarray(pool, dtype=np.int64), np.asarray(sizes, dtype=np.int64))


def test_a_batch_is_packed_in_pool_order_and_runs_side_by_side_merge():
    # ranges 1, 0 and 3 lie side by side in the pool (in that order); range 2 stands apart
    layout = StagingLayout.of(_ranges([100, 40, 500, 160], [60, 60, 8, 24]))
    assert layout.nbytes == 152
    assert layout.offsets.tolist() == [60, 0, 144, 120]  # pool order: 40, 100, 160, 500
    slab, pool, sizes = layout.runs
    assert (slab.tolist(), pool.tolist(), sizes.tolist()) == ([0, 144], [40, 500], [144, 8])


def test_a_layout_keeps_the_ranges_alignment():
    """Offsets in the slab are sums of the sizes: 16 KiB ranges stay 16 KiB aligned, so the gather
    plan moves them as rows of 16 KiB on CUDA."""
    sizes = [16384] * 5
    layout = StagingLayout.of(_ranges([5 * 16384, 0, 3 * 16384, 16384, 9 * 16384], sizes))
    assert all(offset % 16384 == 0 for offset in layout.offsets.tolist())
    assert layout.runs[2].tolist() == [16384 * 2, 16384, 16384, 16384]


def test_a_batch_is_cut_into_pieces_that_cover_each_byte_once():
    """Pieces of at most 50 bytes over the packed layout, in pool order: a range across a cut is
    cut, zero-byte ranges go nowhere, every (local, pool) byte pair lands in exactly one piece."""
    ranges = _ranges([100, 40, 500, 160, 300], [60, 60, 8, 24, 0])
    cut = pieces(ranges, StagingLayout.of(ranges), 50)
    assert [int(piece.sizes.sum()) for piece in cut] == [50, 50, 50, 2]
    pairs = [(int(local) + k, int(pool) + k) for piece in cut
             for local, pool, size in zip(piece.local_offsets, piece.pool_offsets, piece.sizes) for k in range(size)]
    expected = [(int(local) + k, int(pool) + k) for local, pool, size in
                zip(ranges.local_offsets, ranges.pool_offsets, ranges.sizes) for k in range(size)]
    assert sorted(pairs) == sorted(expected) and len(pairs) == len(set(pairs))
    assert [sorted(zip(piece.pool_offsets.tolist(), piece.sizes.tolist())) for piece in cut] == [
        [(40, 50)], [(90, 10), (100, 40)], [(140, 20), (160, 24), (500, 6)], [(506, 2)]]
