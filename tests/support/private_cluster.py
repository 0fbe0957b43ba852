"""A Ray cluster of one or more nodes (raylets) in a process of its own, for tests that need
one apart from the session's: Serve apps driven with ``serve run --address``, multi-node runs.

``PrivateCluster`` starts ``python tests/private_cluster.py SPEC`` and reads the cluster's
address, node ids and metrics ports from its first line; closing its stdin shuts the cluster
down (Ray's own shutdown), and ``close`` waits for that, then ends any process of its family
that is left (only PIDs this test started).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

TEST_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_metrics_report_interval_ms": "1000"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cluster_env() -> dict[str, str]:
    """This process's environment for a child that must never join the session's cluster."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, **TEST_ENV}


@dataclass
class PrivateCluster:
    """``nodes``: per node, its CPUs and custom resources, e.g. ``[{"num_cpus": 2}]``."""

    nodes: list[dict[str, Any]]
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from tests.support.temp_dirs import make_temp_dir  # not at the top: this file is also the cluster's script

        self.temp = make_temp_dir()
        self.temp_dir = self.temp.path
        spec = json.dumps({"nodes": self.nodes, "temp_dir": self.temp_dir,
                           "metrics_ports": [free_port() for _ in self.nodes]})
        self.proc = subprocess.Popen([sys.executable, __file__, spec], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(os.path.join(self.temp_dir, "cluster.err"), "w"), text=True,
                                     env=cluster_env(), start_new_session=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise RuntimeError(f"private cluster did not start: {self.log()}")
        self.info = json.loads(line)

    @property
    def address(self) -> str:
        return str(self.info["address"])

    def log(self) -> str:
        with open(os.path.join(self.temp_dir, "cluster.err")) as f:
            return f.read()[-3000:]

    def close(self, timeout_s: float = 60.0, failed: bool = False) -> None:
        """Shut the cluster down; its temp dir goes unless ``failed`` or a test failed meanwhile."""
        family = psutil.Process(self.proc.pid).children(recursive=True)
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        deadline = time.monotonic() + 10
        for p in family:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except psutil.TimeoutExpired:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.temp.release(failed)


def run_driver(driver: str, args: list[str], nodes: list[dict[str, Any]],
               timeout_s: float) -> tuple[Any, dict[str, Any]]:
    """Run ``tests/support/<driver>`` (given the cluster's address, then ``args``) in a process of
    its own against a fresh ``PrivateCluster`` of ``nodes``, closed afterwards: what the driver
    printed last (one JSON line), and the cluster's info (its node ids)."""
    from tests.support import ROOT

    cluster = PrivateCluster(nodes)
    done = None
    try:
        done = subprocess.run([sys.executable, str(ROOT / "tests/support" / driver), cluster.address, *args],
                              capture_output=True, text=True, timeout=timeout_s, env=cluster_env(), cwd=ROOT)
    finally:
        cluster.close(failed=done is None or done.returncode != 0)
    assert done.returncode == 0, f"{done.stderr[-4000:]}\n(Ray logs kept in {cluster.temp_dir})"
    return json.loads(done.stdout.strip().splitlines()[-1]), cluster.info


def pinned_nodes(count: int) -> list[dict[str, Any]]:
    """``count`` one-CPU nodes, node ``i`` with a ``node_i`` resource (to place actors on it)."""
    return [{"num_cpus": 1, "resources": {f"node_{i}": 1}} for i in range(count)]


def _main(spec: dict[str, Any]) -> None:
    import ray
    from ray.cluster_utils import Cluster

    # Ray writes each added node's cluster address under its default temp dir (/tmp/ray), which a
    # fresh machine lacks until some other Ray run made it: keep that file in ours, too.
    os.environ["RAY_TMPDIR"] = spec["temp_dir"]
    os.makedirs(os.path.join(spec["temp_dir"], "ray"), exist_ok=True)
    cluster = Cluster()
    for i, node in enumerate(spec["nodes"]):
        cluster.add_node(node_ip_address="127.0.0.1", metrics_export_port=spec["metrics_ports"][i],
                         include_dashboard=False, temp_dir=spec["temp_dir"] if i == 0 else None, **node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR")
    by_port = {n["MetricsExportPort"]: n["NodeID"] for n in ray.nodes()}
    print(json.dumps({"address": cluster.address, "metrics_ports": spec["metrics_ports"],
                      "node_ids": [by_port[port] for port in spec["metrics_ports"]]}), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
