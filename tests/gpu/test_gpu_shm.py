"""The shared-memory data path into CUDA memory (K/V-split layout), byte-exact both ways."""

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (none present)")
def test_shm_pool_to_cuda_kv_cache_and_back_is_exact():
    from ucm_ray.transport.gpu_check import run

    r = run(num_blocks=16, block_bytes=1 << 20, reps=1)
    assert r.load_exact and r.save_exact
