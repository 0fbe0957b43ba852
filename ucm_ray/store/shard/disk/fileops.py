"""The disk tier's only contact with the operating system, kept in one object as a seam.

Every system call on the tier's files goes through a ``FileOps``: a test hands the real store
one whose ``pwritev`` raises ENOSPC or EIO, or whose ``replace`` ends the process, and watches
the store react; nothing else is faked. The default is the plain system call each time.

Data files are opened with ``O_DIRECT`` where the file system takes it: the tier streams far
more bytes than the page cache should hold, and cached copies of demoted blocks would take
memory from the pool they were demoted from. Where ``O_DIRECT`` is refused (EINVAL: some FUSE or
overlay file systems) the file is opened buffered, and the store says so once in its log.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Sequence

DIRECT_ALIGN = 4096
"""Offsets, lengths and buffer addresses of ``O_DIRECT`` I/O are multiples of this (the
logical block size of every disk the tier is meant for; 512-byte disks accept it too)."""


def aligned_buffer(size: int) -> mmap.mmap:
    """A zeroed, page-aligned anonymous buffer of ``size`` bytes rounded up to ``DIRECT_ALIGN``."""
    return mmap.mmap(-1, round_up(max(size, 1)))


def round_up(size: int) -> int:
    return -(-size // DIRECT_ALIGN) * DIRECT_ALIGN


class FileOps:
    """Plain system calls; subclass one method to inject a fault."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        return os.open(path, flags, mode)

    def open_data(self, path: str, size: int) -> tuple[int, bool]:
        """Open (creating) one data file preallocated to ``size`` bytes: (fd, direct I/O or not)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        fd: int | None = None
        direct = getattr(os, "O_DIRECT", 0)
        if direct:
            try:
                fd = self.open(path, flags | direct)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
        is_direct = fd is not None
        if fd is None:
            fd = self.open(path, flags)
        try:
            if os.fstat(fd).st_size > size:  # an older, larger layout: never leave bytes past the bound
                os.ftruncate(fd, size)
            self.fallocate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return fd, is_direct

    def fallocate(self, fd: int, size: int) -> None:
        os.posix_fallocate(fd, 0, size)

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def write_synced(self, path: str, data: bytes) -> None:
        """Write a small file whole (the manifest's temporary name) and fsync it."""
        fd = self.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            self.fsync(fd)
        finally:
            os.close(fd)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self.fsync(fd)
        finally:
            os.close(fd)
