"""The ``ucm-ray`` command against a running cluster: up, status, down, and bad flags."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import ray
import torch

from tests.support.prometheus import DASHBOARD, dashboard_exprs, parse_samples, promql_metric_names
from tests.support.store_helpers import ClientProcess, block, key, read_back
from ucm_ray.config import UcmRayConfig
from ucm_ray.store.engine.client import StoreClient
from ucm_ray.store.shard.fleet import fleet_status


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
    assert all(s["hit_rate"] is None for s in status["shards"])  # nobody asked yet

    # 20 blocks written, then read back with 5 absent keys: 25 lookups, 20 hits over the two shards
    fleet = UcmRayConfig.from_dict({"num_shards": 2, "pool_bytes": 32 << 20, "ray_namespace": "cli_test",
                                    "transport": "shm"})
    assert all(ray.get(ClientProcess.remote(fleet.to_dict()).write.remote(20), timeout=120))
    client = StoreClient(fleet)
    assert all(read_back(client, 20)[0])
    client.release(client.acquire([key(i, "absent") for i in range(5)]).result().lease_ids).result()
    client.close()
    st = cli("status", "--address", address, "--config", str(conf), "--json")
    shards = json.loads(st.stdout)["shards"]
    assert (sum(s["lookups"] for s in shards), sum(s["hits"] for s in shards)) == (25, 20)
    assert sum(s["entries"] for s in shards) == 20
    for s in shards:
        assert s["hit_rate"] == (s["hits"] / s["lookups"] if s["lookups"] else None)
        assert s["node_id"] == ray.get_runtime_context().get_node_id() and s["node_ip"] == "127.0.0.1"
        for figure in ("entries", "used_bytes", "capacity_bytes", "evictions", "dropped_saves"):
            assert isinstance(s[figure], int), figure

    # the table: per shard node, entries, used/capacity, hit rate, evictions (same figures)
    table = cli("status", "--address", address, "--config", str(conf))
    assert table.returncode == 0, table.stderr[-2000:]
    print(table.stdout)
    lines = table.stdout.splitlines()
    assert re.fullmatch(r"membership v\d+, 2 shard\(s\)", lines[0])
    header = re.split(r"\s{2,}", lines[1])
    assert header == ["SHARD", "NODE", "ENTRIES", "USED / CAPACITY", "USE", "HIT RATE", "LOOKUPS", "EVICTIONS",
                      "DROPPED SAVES"]
    rows = {row[0]: dict(zip(header, row)) for row in (re.split(r"\s{2,}", line) for line in lines[2:])}
    assert len(lines) == 4 and set(rows) == {s["shard_id"] for s in shards}
    for s in shards:
        row = rows[s["shard_id"]]
        assert row["NODE"] == f"127.0.0.1 {s['node_id'][:8]}"
        assert row["ENTRIES"] == str(s["entries"]) and row["EVICTIONS"] == "0" and row["DROPPED SAVES"] == "0"
        assert row["USED / CAPACITY"].endswith(" / 32.0 MiB") and row["LOOKUPS"] == str(s["lookups"])
        assert row["HIT RATE"] == (f"{s['hits'] / s['lookups']:.2f}" if s["lookups"] else "-")
    down = cli("down", "--address", address, "--config", str(conf))
    assert down.returncode == 0 and "stopped 2 shard(s)" in down.stdout
    gone = cli("status", "--address", address, "--config", str(conf))
    assert gone.returncode == 1 and "no ucm-ray fleet" in gone.stderr


def test_bad_flag_is_named_before_anything_starts():
    r = cli("up", "--replication", "3", "--num-shards", "2")
    assert r.returncode == 2 and "replication" in r.stderr and "between 1 and num_shards" in r.stderr


def test_up_with_a_disk_tier_keeps_its_files_on_down_and_purges_them_on_request(ray_cluster, tmp_path):
    """``up`` with disk_dir runs the tier (status shows it); ``down`` unlinks the pools but keeps
    the disk files, whose entries the next ``up`` adopts; ``down --purge-disk`` deletes them."""
    address = ray.get_runtime_context().gcs_address
    disk = tmp_path / "disk"
    disk.mkdir()
    conf = tmp_path / "fleet.yaml"
    conf.write_text(f"num_shards: 1\npool_bytes: 4MiB\nray_namespace: cli_disk\ntransport: shm\n"
                    f"disk_dir: {disk}\ndisk_bytes: 16MiB\ndisk_write_policy: through\n")
    fleet = UcmRayConfig.from_yaml(str(conf))
    up = cli("up", "--address", address, "--config", str(conf))
    assert up.returncode == 0, up.stderr[-2000:]
    assert all(ray.get(ClientProcess.remote(fleet.to_dict()).write.remote(20), timeout=120))
    deadline = time.monotonic() + 30
    while (shard := fleet_status(fleet)["shards"][0])["disk_entries"] < 20:
        assert time.monotonic() < deadline, shard  # write-through: every commit reaches disk
        time.sleep(0.2)
    # the disk figures in `ucm-ray status` and on Ray's Prometheus export (every ~5-10 s)
    table = cli("status", "--address", address, "--config", str(conf)).stdout.splitlines()
    header = re.split(r"\s{2,}", table[1])
    row = dict(zip(header, re.split(r"\s{2,}", table[2])))
    assert header[-2:] == ["DISK USED / CAPACITY", "DISK PROMOTED"]
    assert row["DISK USED / CAPACITY"].endswith("/ 16.0 MiB") and row["DISK PROMOTED"] == "0"
    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    while True:
        shard = fleet_status(fleet)["shards"][0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            samples = {(n, lab.get("shard")): v for n, lab, v in parse_samples(r.read().decode())}
        exported = (samples.get(("ray_ucm_ray_shard_disk_demoted_total", shard["shard_id"])),
                    samples.get(("ray_ucm_ray_shard_disk_entries", shard["shard_id"])))
        if exported == (shard["disk_demoted"], shard["disk_entries"]) == (20, 20):
            break
        assert time.monotonic() < deadline + 60, (exported, shard)
        time.sleep(1)
    pools = [p for p in os.listdir(fleet.shm_dir) if "cli_disk" in p]
    assert pools, "the shard's pool and index are in shm_dir while it runs"
    assert cli("down", "--address", address, "--config", str(conf)).returncode == 0
    assert not [p for p in os.listdir(fleet.shm_dir) if "cli_disk" in p], "down unlinks the pools"
    assert os.listdir(disk), "down keeps the disk tier's files"

    up = cli("up", "--address", address, "--config", str(conf))  # adopts what the disk holds
    assert up.returncode == 0, up.stderr[-2000:]
    shard = fleet_status(fleet)["shards"][0]
    assert (shard["entries"], shard["disk_adopted"]) == (0, 20)  # an empty pool, the disk's entries
    client = StoreClient(fleet)  # local_lookups: the published index lists them as on disk
    found, copies = read_back(client, 20)
    assert all(found), found
    assert all(torch.equal(copy, block(i)) for i, copy in enumerate(copies))
    client.close()
    # the dashboard's disk panels chart what this shard exports (tests/e2e/test_metrics.py's fleet
    # has no disk tier); counters appear once they moved, promotions included now
    charted = {n for e in dashboard_exprs(json.loads(DASHBOARD.read_text())) for n in promql_metric_names(e)
               if n.startswith("ray_ucm_ray_shard_disk_")}
    assert len(charted) >= 4, charted
    deadline = time.monotonic() + 60
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            exported = {n for n, _, _ in parse_samples(r.read().decode())}
        if charted <= exported:
            break
        assert time.monotonic() < deadline, f"the dashboard charts disk metrics nobody exports: {charted - exported}"
        time.sleep(1)
    down = cli("down", "--address", address, "--config", str(conf), "--purge-disk")
    assert down.returncode == 0 and "purged the disk tier files of 1 shard(s)" in down.stdout, down.stdout
    assert os.listdir(disk) == []


def test_bad_disk_settings_are_one_line_before_anything_starts(tmp_path):
    r = cli("up", "--disk-dir", "/nonexistent/ucm", "--disk-bytes", "1GiB")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "disk_dir" in r.stderr, r.stderr
    r = cli("up", "--disk-dir", str(tmp_path), "--disk-bytes", "1GiB", "--disk-wait-s", "9")
    assert r.returncode == 2 and "disk_wait_s" in r.stderr and "below lookup_timeout_s" in r.stderr, r.stderr
    r = cli("down", "--purge-disk")
    assert r.returncode == 2 and "--purge-disk needs the fleet's disk_dir" in r.stderr, r.stderr
