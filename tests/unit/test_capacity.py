"""The pool-size check that runs before any actor starts."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from ucm_ray.config import ConfigError
from ucm_ray.store.shard.capacity import check_pool_fits, free_bytes, human_bytes
from ucm_ray.transport.shm import SharedPool

NOBODY = 65534


def test_human_bytes():
    assert [human_bytes(n) for n in (40 << 30, 12 << 30, 3 << 29, 512 << 20, 1536, 100, 16 << 40)] == [
        "40 GiB", "12 GiB", "1.5 GiB", "512 MiB", "1.5 KiB", "100 bytes", "16 TiB"]


def test_free_bytes_is_what_statvfs_says(tmp_path):
    st = os.statvfs(tmp_path)
    assert abs(free_bytes(str(tmp_path)) - st.f_bavail * st.f_frsize) < 64 << 20  # others write too


def test_pools_that_do_not_fit_are_one_line_naming_pool_bytes():
    free = free_bytes("/dev/shm")
    pool = free // 2 + (1 << 20)
    with pytest.raises(ConfigError) as e:
        check_pool_fits("/dev/shm", pool, 3)
    msg = str(e.value)
    assert re.fullmatch(r"pool_bytes: 3 pools of [\d.]+ [KMGT]iB do not fit /dev/shm's [\d.]+ [KMGT]iB free "
                        r"\(lower pool_bytes or num_shards, or give /dev/shm more memory\)", msg), msg
    assert human_bytes(pool) in msg
    with pytest.raises(ConfigError, match=r"^pool_bytes: 1 pool of .* does not fit /dev/shm's "):
        check_pool_fits("/dev/shm", free + (1 << 30), 1)


def test_pools_that_fit_pass_and_really_fit(tmp_path):
    check_pool_fits(str(tmp_path), 1 << 20, 4)
    check_pool_fits(str(tmp_path), 1 << 60, 0)  # nothing to create
    pools = [SharedPool(str(tmp_path / f"p{i}"), 1 << 20, create=True) for i in range(4)]
    for p in pools:
        p.close()
    assert list(tmp_path.iterdir()) == []


def test_a_directory_that_cannot_be_read_names_shm_dir(tmp_path):
    with pytest.raises(ConfigError, match=r"^shm_dir: cannot read the free space of '/nonexistent/x'"):
        check_pool_fits("/nonexistent/x", 4096, 1)


def test_a_directory_this_user_cannot_write_names_shm_dir():
    """Run as ``nobody`` when we are root (root may write anywhere)."""
    parent = Path(tempfile.mkdtemp(prefix="ucmr-ro-", dir="/tmp"))
    target = parent / "shm"
    target.mkdir()
    parent.chmod(0o755)
    target.chmod(0o555)

    def check() -> int:
        try:
            check_pool_fits(str(target), 4096, 1)
        except ConfigError as e:
            return 0 if re.match(r"^shm_dir: .* is not writable by this user$", str(e)) else 1
        return 2

    try:
        if os.geteuid() != 0:
            assert check() == 0
            return
        pid = os.fork()
        if pid == 0:  # the child: become nobody, check, report through the exit code
            code = 3
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                code = check()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "0: one line naming shm_dir; 1: another message; 2: none"
    finally:
        target.chmod(0o700)
        shutil.rmtree(parent)
