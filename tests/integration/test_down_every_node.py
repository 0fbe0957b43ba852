"""`ucm-ray down` frees leftover pools on every node, not only on the one it runs on.

A shard killed with ``kill -9`` on another node leaves its pool file there; ``stop_fleet``
runs one small task pinned to each alive node that removes this fleet's files on that node.
All raylets of a ``PrivateCluster`` share this host's ``/dev/shm``, so the proof that every
node was cleaned is that every node's task ran (it reports its node id), plus the files gone.
"""

from __future__ import annotations

import time

from tests.support.private_cluster import run_driver


def test_down_runs_a_cleanup_task_on_every_node():
    t0 = time.monotonic()
    result, cluster = run_driver("down_driver.py", [], [{"num_cpus": 1} for _ in range(3)], 120)
    assert sorted(result["ran"]) == sorted(cluster["node_ids"]), "every node ran its cleanup task"
    assert len(result["planted"]) == 2 and result["left"] == []
    assert sum(result["ran"].values()) >= 2, "the planted files were removed by the node tasks"
    assert result["stopped"] == 1
    print(f"down on 3 nodes: {time.monotonic() - t0:.1f} s")
