"""Stale pool files: cleanup touches only this user's files of this Ray cluster and namespace.

Stale-pool cleanup runs where a shard starts and in ``down``; it used to unlink whatever matched
``ucmray-<ray namespace>-<shard>``, so another local user's entry of that name in sticky
``/dev/shm`` made shards fail (PermissionError), and a second Ray cluster on the host with the
same Ray namespace deleted the first one's live pools.
"""

from __future__ import annotations

import os
import signal
import tempfile
import uuid
from pathlib import Path

from tests.support.local_fleet import LocalFleet
from ucm_ray.transport.shm import pool_prefix, remove_stale_pools

NOBODY = 65534


def _touch(path: Path) -> Path:
    path.write_bytes(b"\0" * 4096)
    return path


def test_a_matching_entry_that_cannot_be_removed_is_left_alone(tmp_path):
    # Written out, not from pool_prefix: a name the cleanup of shard 0 matches, however named.
    prefix = str(tmp_path / "ucmray-ns-0123456789ab-ucm_ray_shard_0-")
    (tmp_path / "ucmray-ns-0123456789ab-ucm_ray_shard_0-dir").mkdir()  # unlink() cannot remove it
    stale = _touch(tmp_path / "ucmray-ns-0123456789ab-ucm_ray_shard_0-f00d")
    assert remove_stale_pools(prefix) == 1
    assert not stale.exists() and (tmp_path / "ucmray-ns-0123456789ab-ucm_ray_shard_0-dir").is_dir()


def test_another_users_file_is_left_alone(tmp_path):
    prefix = str(tmp_path / "ucmray-ns-0123456789ab-ucm_ray_shard_0-")
    theirs = _touch(Path(prefix + "beef"))
    ours = _touch(Path(prefix + "f00d"))
    if os.geteuid() != 0:  # only root can give a file away: clean up as another user would see ours
        assert remove_stale_pools(prefix, uid=os.geteuid() + 1) == 0
        assert theirs.exists() and ours.exists()
        return
    os.chown(theirs, NOBODY, NOBODY)
    assert remove_stale_pools(prefix) == 1
    assert theirs.exists() and not ours.exists()


def test_a_shard_of_another_user_starts_beside_our_file_in_sticky_shm():
    """The issue's case, turned around: we are the other user whose file sits in a sticky
    directory; a cleanup run as user ``nobody`` (as a shard of theirs would) must not raise.
    Without root (no other user to become), an unlink refused by a read-only directory stands in."""
    if os.geteuid() != 0:
        locked = Path(tempfile.mkdtemp(prefix="ucmr-ro-", dir="/tmp"))
        ours = _touch(locked / "ucmray-ns-0123456789ab-ucm_ray_shard_0-beef")
        locked.chmod(0o500)
        try:
            assert remove_stale_pools(str(locked / "ucmray-ns-0123456789ab-ucm_ray_shard_0-")) == 0
            assert ours.exists()
        finally:
            locked.chmod(0o700)
            ours.unlink()
            locked.rmdir()
        return
    sticky = Path(tempfile.mkdtemp(prefix="ucmr-sticky-", dir="/tmp"))
    try:
        sticky.chmod(0o1777)
        prefix = str(sticky / "ucmray-ns-0123456789ab-ucm_ray_shard_0-")
        ours = _touch(Path(prefix + "beef"))
        pid = os.fork()
        if pid == 0:  # the child: become nobody, clean up, report through the exit code
            code = 3
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                code = 0 if remove_stale_pools(prefix) == 0 else 1
            except PermissionError:
                code = 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "0 ok, 1 removed our file, 2 PermissionError"
        assert ours.exists()
    finally:
        for p in sticky.iterdir():
            p.unlink()
        sticky.rmdir()


def test_ownership_is_checked_on_the_real_file(tmp_path):
    from ucm_ray.transport.shm import is_own_file

    f = _touch(tmp_path / "ucmray-ns-0123456789ab-ucm_ray_shard_0-f00d")
    (tmp_path / "ucmray-ns-0123456789ab-ucm_ray_shard_0-link").symlink_to(f)
    st = os.lstat(f)
    assert is_own_file(st) and is_own_file(st, os.geteuid())
    assert not is_own_file(st, os.geteuid() + 1)
    assert not is_own_file(os.lstat(tmp_path / "ucmray-ns-0123456789ab-ucm_ray_shard_0-link"))
    assert not is_own_file(os.lstat(tmp_path))
    prefix = str(tmp_path / "ucmray-ns-0123456789ab-ucm_ray_shard_0-")
    assert remove_stale_pools(prefix, uid=os.geteuid() + 1) == 0 and f.exists()
    assert remove_stale_pools(prefix) == 1 and not f.exists()  # the link is not ours to follow
    assert (tmp_path / "ucmray-ns-0123456789ab-ucm_ray_shard_0-link").is_symlink()


def test_two_clusters_prefixes_never_match_each_other(tmp_path):
    from ucm_ray.transport.shm import cluster_tag

    a, b = cluster_tag("session_2026-01-01_00-00-00_000001_1"), cluster_tag("session_2026-01-01_00-00-00_000002_2")
    assert a != b and len(a) == 12 and int(a, 16) >= 0
    files = {}
    for tag in (a, b):
        files[tag] = _touch(Path(pool_prefix(str(tmp_path), "ucm_ray", "ucm_ray_shard_0", cluster=tag) + "-f00d"))
    # A shard's own start (its shard id) and `down` (every shard) of cluster a:
    assert remove_stale_pools(pool_prefix(str(tmp_path), "ucm_ray", "ucm_ray_shard_0", cluster=a) + "-") == 1
    assert remove_stale_pools(pool_prefix(str(tmp_path), "ucm_ray", "ucm_ray_shard_", cluster=a)) == 0
    assert not files[a].exists() and files[b].exists()


def test_a_fleet_leaves_another_clusters_live_pools_alone(ray_cluster, tmp_path):
    """Two Ray clusters on one host, one Ray namespace: this session's and a ``up --local``."""
    from ucm_ray.config import UcmRayConfig
    from ucm_ray.store.shard.fleet import start_fleet, stop_fleet

    ns = f"t{uuid.uuid4().hex[:8]}"
    shm = tmp_path / "shm"
    shm.mkdir()
    flags = ["--ray-namespace", ns, "--num-shards", "1", "--pool-bytes", "1MiB", "--transport", "shm",
             "--shm-dir", str(shm)]
    other = LocalFleet(tmp_path, *flags)
    try:
        other.wait_running()
        theirs = other.pools(str(shm), ns)
        assert len(theirs) == 2, theirs  # its shard's pool and published index
        cfg = UcmRayConfig(ray_namespace=ns, num_shards=1, pool_bytes=1 << 20, transport="shm", shm_dir=str(shm))
        start_fleet(cfg)  # shard 0 of this cluster cleans up after its predecessors
        try:
            assert all(map(os.path.exists, theirs)), "starting a shard removed another cluster's live pool"
            assert len(other.pools(str(shm), ns)) == 4
        finally:
            stop_fleet(cfg)  # `down` cleans up after every shard of this cluster
        assert other.pools(str(shm), ns) == theirs, "down removed another cluster's live pool"
        assert other.stop(signal.SIGINT) == 0, other.log()
        assert other.pools(str(shm), ns) == []
    finally:
        other.close()
