"""The shared-memory data path into CUDA memory (K/V-split layout), byte-exact both ways, through
the copy engines' batches (CUDA 12.8+) and through the gather kernel (older runtimes)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (none present)")
@pytest.mark.parametrize("batch_copies", [True, False])
def test_shm_pool_to_cuda_kv_cache_and_back_is_exact(monkeypatch, batch_copies):
    from ucm_ray.transport.batch_copy import BatchCopier
    from ucm_ray.transport.gpu_check import run
    from ucm_ray.transport.shm import ShmPoolTransport

    major, minor = (int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])
    if batch_copies and (major, minor) >= (12, 8):
        torch.cuda.init()
        assert BatchCopier.load(torch.cuda.current_device()) is not None, "CUDA 12.8+ has batched copies"
    monkeypatch.setattr(ShmPoolTransport, "batch_copies", batch_copies)
    r = run(num_blocks=16, block_bytes=1 << 20, reps=1)
    assert r.load_exact and r.save_exact
