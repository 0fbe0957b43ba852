"""The unit tier: no Ray cluster, no engine, so that `make test-fast` stays an edit-test loop.

A test here that asks for a Ray fixture is refused at collection, not left to slow the tier down
silently: it belongs in ``tests/integration`` (Ray) or ``tests/e2e`` (real engines)."""

from __future__ import annotations

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
