"""`ucm-ray down` frees leftover pools on every node, not only on the one it runs on.

A shard killed with ``kill -9`` on another node leaves its pool file there; ``stop_fleet``
runs one small task pinned to each alive node that removes this fleet's files on that node.
All raylets of a ``PrivateCluster`` share this host's ``/dev/shm``, so the proof that every
node was cleaned is that every node's task ran (it reports its node id), plus the files gone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from tests.support import ROOT
from tests.support.private_cluster import PrivateCluster, cluster_env


def test_down_runs_a_cleanup_task_on_every_node():
    t0 = time.monotonic()
    cluster = PrivateCluster([{"num_cpus": 1} for _ in range(3)])
    try:
        done = subprocess.run([sys.executable, str(ROOT / "tests/support/down_driver.py"), cluster.address],
                              capture_output=True, text=True, timeout=120, env=cluster_env(), cwd=ROOT)
    finally:
        cluster.close()
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(result["ran"]) == sorted(cluster.info["node_ids"]), "every node ran its cleanup task"
    assert len(result["planted"]) == 2 and result["left"] == []
    assert sum(result["ran"].values()) >= 2, "the planted files were removed by the node tasks"
    assert result["stopped"] == 1
    print(f"down on 3 nodes: {time.monotonic() - t0:.1f} s")
