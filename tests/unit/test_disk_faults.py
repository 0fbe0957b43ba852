"""A full or failing disk under the tier, from the kernel, not from a stand-in of our code: the
tier turns off with one error line and its counters say so, and the pool (the DRAM tier) goes on.

- The manifest's temporary name is made a link to ``/dev/full``: the kernel answers its write with
  ENOSPC (any user, any machine).
- Real small file systems, mounted by this process (root, as on this box and CI's): a tmpfs whose
  inodes are used up (the tier cannot even make its directory), and an ext4 image on a loop
  device whose backing tmpfs is smaller than the image (the preallocated data file's writes get
  ENOSPC from below, as on a thin-provisioned volume). Without root those two fail at their mount.
- EIO from the block layer: the loop device under a mounted ext4 is shrunk (its image truncated,
  ``losetup -c``), and a read of a block past its new end fails as a dead sector's would. (This
  box's kernel has no device-mapper, so no ``dm-error`` target.)
"""

from __future__ import annotations

import logging
import os
import subprocess

import pytest
import torch

from tests.unit import test_disk_tier as tier_tests
from tests.unit.test_disk_tier import SLOT, PublishedShard, digest_keys, payload
from ucm_ray.store.shard.disk import DiskStore
from ucm_ray.store.shard.disk.store import MANIFEST, shard_dir

STORE_LOG = "ucm_ray.store.shard.disk.store"


def errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def assert_dram_goes_on(s: PublishedShard, first: int) -> None:
    """The pool keeps taking and serving entries, with plain LRU eviction, and nothing is listed
    as "ask the shard" any more (a reader must not wait on a tier that is off)."""
    dirty_before = s.index.stats().evicted_dirty
    for i in range(first, first + 8):
        s.write(i)
    assert all(torch.equal(s.read(i), payload(i)) for i in range(first + 4, first + 8))
    assert s.demote_all() == 0 and not s.tier.behind()
    assert s.index.stats().evicted_dirty == dirty_before  # not "demotion fell behind": there is none
    assert "ask" not in s.lookup(*range(first + 8))


def test_a_full_disk_at_the_manifest_turns_the_tier_off_and_the_pool_goes_on(tmp_path, index_file, monkeypatch,
                                                                              caplog):
    digest_keys(monkeypatch)
    caplog.set_level(logging.INFO, logger=STORE_LOG)
    s = PublishedShard(str(tmp_path), 4, 16, index_file, write_through=True)
    for i in range(4):
        s.write(i)
    s.demote_all()
    for i in range(4, 6):
        s.write(i)  # evicts 0 and 1 (clean): only the disk holds them
    assert s.lookup(0, 1) == ["ask", "ask"]
    os.symlink("/dev/full", os.path.join(shard_dir(str(tmp_path), "s0"), MANIFEST + ".tmp"))
    s.disk.checkpoint()  # as the demotion thread's next manifest would
    s.demote_all()  # the thread's next round: the tier hands back what the disk no longer holds
    stats = s.tier.disk_stats()
    assert not stats.enabled and stats.io_errors == 1 and stats.entries == 0
    (line,) = errors(caplog)
    assert "turned off" in line and "ENOSPC" in line and "writing its manifest" in line, line
    assert s.lookup(0, 1) == ["miss", "miss"]  # unlisted: recomputed, never asked of a dead tier
    assert s.tier.promote([tier_tests.key(0)]) == [False]
    assert_dram_goes_on(s, 10)
    assert len(errors(caplog)) == 1


@pytest.fixture
def mounts(tmp_path):
    """Mount helpers; everything mounted is unmounted (and loop devices detached) at the end."""
    done: list[str] = []

    def mount(*args: str) -> str:
        target = str(tmp_path / f"m{len(done)}")
        os.mkdir(target)
        subprocess.run(["mount", *args, target], check=True, capture_output=True)
        done.append(target)
        return target

    yield mount
    for target in reversed(done):  # a loop mount's device is detached with it
        if subprocess.run(["umount", target], capture_output=True).returncode:
            subprocess.run(["umount", "-l", target], check=False)  # a failed test left files open


def test_a_file_system_out_of_inodes_leaves_the_tier_off_not_the_shard(mounts, caplog):
    root = mounts("-t", "tmpfs", "-o", "size=1m,nr_inodes=2", "tmpfs")
    os.mkdir(os.path.join(root, "taken"))  # the last inode: the tier's directory finds none
    caplog.set_level(logging.INFO, logger=STORE_LOG)
    store = DiskStore([root], "s0", 16 * SLOT)
    assert not store.enabled and store.snapshot().io_errors == 1
    assert not store.put(b"k", payload(0))
    (line,) = errors(caplog)
    assert "turned off" in line and "ENOSPC" in line, line
    store.close()


def test_a_volume_that_fills_under_the_preallocated_files_turns_the_tier_off(mounts, tmp_path, index_file,
                                                                              monkeypatch, caplog):
    """ext4 on a 64 MiB image whose tmpfs holds 3 MiB: the tier's 16 MiB preallocate (extents
    only), its writes find no room below once the tmpfs is full."""
    digest_keys(monkeypatch)
    backing = mounts("-t", "tmpfs", "-o", "size=3m", "tmpfs")
    image = os.path.join(backing, "image")
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-O", "^has_journal", image], check=True)
    root = mounts("-o", "loop", image)
    caplog.set_level(logging.INFO, logger=STORE_LOG)
    s = PublishedShard(root, 8, (16 << 20) // SLOT, index_file, write_through=True)
    written = 0
    while s.tier.disk_stats().enabled:
        for i in range(written, written + 8):
            s.write(i)
        s.demote_all()
        written += 8
        assert written < 1000, "the disk never filled"
    stats = s.tier.disk_stats()
    assert stats.io_errors >= 1 and stats.entries == 0
    (line,) = errors(caplog)
    assert "turned off" in line and "ENOSPC" in line, line
    assert_dram_goes_on(s, written)


def test_a_read_that_fails_below_the_file_system_turns_the_tier_off(mounts, tmp_path, index_file, monkeypatch,
                                                                      caplog):
    """ext4 on a loop device, entries on disk only; the device is then shrunk to 2 MiB under the
    mounted file system: the kernel answers the promotion's read with EIO ("attempt to access
    beyond end of device"). The key is a miss, the tier is off with one line, the pool goes on."""
    digest_keys(monkeypatch)
    image = str(tmp_path / "image")
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-O", "^has_journal", image], check=True)
    root = mounts("-o", "loop", image)
    device = subprocess.run(["findmnt", "-no", "SOURCE", root], check=True, capture_output=True, text=True).stdout
    caplog.set_level(logging.INFO, logger=STORE_LOG)
    s = PublishedShard(root, 8, (16 << 20) // SLOT, index_file, write_through=True)
    for i in range(8):
        s.write(i)
    s.demote_all()
    for i in range(8, 16):
        s.write(i)  # 0..7 on disk only
    assert s.lookup(0) == ["ask"]
    os.truncate(image, 2 << 20)
    subprocess.run(["losetup", "-c", device.strip()], check=True)
    assert s.tier.promote([tier_tests.key(0)]) == [False]
    stats = s.tier.disk_stats()
    assert not stats.enabled and stats.io_errors == 1 and stats.entries == 0
    (line,) = errors(caplog)
    assert "turned off" in line and "EIO" in line and "reading" in line, line
    assert s.lookup(0) == ["miss"]
    assert_dram_goes_on(s, 20)
