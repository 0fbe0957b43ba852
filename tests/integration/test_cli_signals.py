"""``ucm-ray up --local`` stops cleanly on SIGTERM (what Kubernetes and systemd send) as on Ctrl-C."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from tests.support.local_fleet import LocalFleet


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_a_local_fleet_and_frees_its_pools(tmp_path, sig):
    ns = f"t{uuid.uuid4().hex[:8]}"
    fleet = LocalFleet(tmp_path, "--ray-namespace", ns, "--num-shards", "2", "--pool-bytes", "1MiB",
                       "--transport", "shm")
    try:
        fleet.wait_running()
        assert len(fleet.pools("/dev/shm", ns)) == 4  # two pools, two published indexes
        started = time.monotonic()
        rc = fleet.stop(sig, timeout_s=120)
        assert rc == 0, f"exit code {rc} after {sig.name}:\n{fleet.log()}"
        assert fleet.pools("/dev/shm", ns) == [], f"pools left in /dev/shm after {sig.name}"
        assert time.monotonic() - started < 120
        assert fleet.leftover_processes() == [], "Ray processes outlived ucm-ray up --local"
    finally:
        fleet.close()
        for path in fleet.pools("/dev/shm", ns):  # never leave anything behind, even when failing
            os.unlink(path)
