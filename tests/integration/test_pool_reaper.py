"""A shard's pool file goes away however the shard ends: ``kill -9`` with no restart, and
the end of the Ray cluster it lived in without ``ucm-ray down`` (``ray.shutdown()`` of a
local cluster; what ``serve run`` does on Ctrl-C)."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from tests.support.store_helpers import shard_pid
from tests.support.temp_dirs import make_temp_dir


def _gone(paths: list[str], timeout_s: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in paths if os.path.exists(p)]
        if not left:
            return []
        time.sleep(0.1)
    return left


def test_pool_of_a_killed_shard_that_never_restarts_is_unlinked(fleet):
    cfg = fleet(num_shards=2, transport="shm")
    pools = glob.glob(os.path.join(cfg.shm_dir, f"ucmray-{cfg.ray_namespace}-*shard_0-*"))
    assert len(pools) == 2, pools  # the pool and its published index
    os.kill(shard_pid(cfg, 0), signal.SIGKILL)
    assert _gone(pools) == [], "the killed shard's pool or index is still in /dev/shm"


SCRIPT = textwrap.dedent("""
    import glob, json, ray, sys
    from ucm_ray.config import UcmRayConfig
    from ucm_ray.store.shard.fleet import start_fleet
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR",
             _temp_dir=sys.argv[1])
    cfg = UcmRayConfig(num_shards=2, pool_bytes=16 << 20, transport="shm", ray_namespace=sys.argv[2])
    start_fleet(cfg)
    print(json.dumps(glob.glob(f"/dev/shm/ucmray-{cfg.ray_namespace}-*")), flush=True)
    ray.shutdown()  # no `ucm-ray down`: the cluster ends with its shards
""")


def test_pools_go_with_the_cluster_that_ends_without_down(tmp_path):
    namespace = f"reap{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # never the session's cluster
    ray_tmp = make_temp_dir()
    done = subprocess.run([sys.executable, "-c", SCRIPT, ray_tmp.path, namespace],
                          capture_output=True, text=True, timeout=180, env=env)
    ray_tmp.release(failed=done.returncode != 0)
    assert done.returncode == 0, done.stderr[-3000:]
    pools = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(pools) == 4, pools  # two shards' pools and published indexes
    left = _gone(pools)
    for path in left:  # do not leave them to the next run
        os.unlink(path)
    assert left == [], "pools outlived their cluster"


def test_pools_go_when_the_driver_of_their_cluster_is_killed(tmp_path):
    """``kill -9`` of the process that started a local cluster (a driver, ``ucm-ray up --local``):
    Ray's workers then exit killing their child processes, so a watcher that is the shard's
    child would die before it removed the pool (it did)."""
    namespace = f"reapk{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    script = SCRIPT.replace("ray.shutdown()  # no `ucm-ray down`: the cluster ends with its shards",
                            "import time; time.sleep(600)")
    ray_tmp = make_temp_dir()
    driver = subprocess.Popen([sys.executable, "-c", script, ray_tmp.path, namespace],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                              start_new_session=True)
    try:
        assert driver.stdout is not None
        pools = json.loads(driver.stdout.readline())
        assert len(pools) == 4, pools  # two pools, two indexes
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and the cluster processes it started
        driver.wait(30)
        ray_tmp.release()
    left = _gone(pools, timeout_s=30)
    for path in left:
        os.unlink(path)
    assert left == [], "pools outlived the killed driver's cluster"
