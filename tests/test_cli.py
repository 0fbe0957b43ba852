"""The ``ucm-ray`` command against a running cluster: up, status, down, and bad flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ray


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "ucm_ray.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_up_status_down(ray_cluster, tmp_path):
    address = ray.get_runtime_context().gcs_address
    conf = tmp_path / "fleet.yaml"
    conf.write_text("num_shards: 2\npool_bytes: 32MiB\nray_namespace: cli_test\ntransport: shm\n")
    up = cli("up", "--address", address, "--config", str(conf))
    assert up.returncode == 0, up.stderr[-2000:]
    st = cli("status", "--address", address, "--config", str(conf), "--json")
    assert st.returncode == 0, st.stderr[-2000:]
    status = json.loads(st.stdout)
    assert [s["capacity_bytes"] for s in status["shards"]] == [32 << 20] * 2
    down = cli("down", "--address", address, "--config", str(conf))
    assert down.returncode == 0 and "stopped 2 shard(s)" in down.stdout
    gone = cli("status", "--address", address, "--config", str(conf))
    assert gone.returncode == 1 and "no ucm-ray fleet" in gone.stderr


def test_bad_flag_is_named_before_anything_starts():
    r = cli("up", "--replication", "3", "--num-shards", "2")
    assert r.returncode == 2 and "replication" in r.stderr and "between 1 and num_shards" in r.stderr
