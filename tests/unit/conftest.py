"""The unit tier: no Ray cluster, no engine, so that `make test-fast` stays an edit-test loop.

A test here that asks for a Ray fixture is refused at collection, not left to slow the tier down
silently: it belongs in ``tests/integration`` (Ray) or ``tests/e2e`` (real engines)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
RAY_FIXTURES = frozenset({"ray_cluster", "fleet", "fleet_config"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            uses = RAY_FIXTURES.intersection(getattr(item, "fixturenames", ()))
            if uses:
                raise pytest.UsageError(f"{item.nodeid} is in the unit tier but uses {sorted(uses)}: "
                                        "move it to tests/integration or tests/e2e")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A model directory for the two-halves harness (vLLM's real scheduler, no weights loaded)."""
    from ucm_ray.testing.harness import write_model_dir  # vLLM: imported by the tests that use it only

    return write_model_dir(str(tmp_path_factory.mktemp("model")))


@pytest.fixture
def store():
    """Both halves of the store in this process: two shards' pools, unlinked afterwards."""
    from ucm_ray.store.local import LocalBlockStore

    local = LocalBlockStore(num_shards=2, pool_bytes=64 << 20)
    yield local
    local.shutdown()


@pytest.fixture
def index_file():
    """A path for a published index in /dev/shm (the disk-tier tests), removed afterwards."""
    path = f"/dev/shm/ucmray-test-tier-index-{os.getpid()}-{random.randrange(1 << 30)}"
    yield path
    if os.path.exists(path):
        os.unlink(path)
