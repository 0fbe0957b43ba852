"""NIXL's POSIX backend (libaio, io_uring) against the disk tier's own reads, same file, same run.

The question (issue 42, ``disk_io: auto``): does moving the tier's promotion reads to NIXL's POSIX
plugin pay here? Each round reads the same extents of one ``O_DIRECT`` file, as a promotion does:
chunks of 32 entries that lie next to each other, into a pool-sized buffer, four ways, in turn:

- ``preadv_1``: one ``os.preadv`` per entry, depth 1 (``disk_tier.py``'s raw baseline);
- ``preadv_tier``: the tier's reads: a chunk's entries coalesced into reads of at most
  ``COALESCE_BYTES``, on ``READ_DEPTH`` threads;
- ``nixl_aio`` / ``nixl_uring``: one NIXL transfer per chunk, a descriptor per entry (the plugin
  queues them all), with the pool and the file registered once; ``_coalesced``: a descriptor per
  read of ``preadv_tier``.

Reads only (no checksum, no copy: those are the tier's either way). Prints GB/s per way, median of
``--rounds``, and ``nixl_vs_tier=`` (the better NIXL way over ``preadv_tier``) per entry size.

Run: ``python benchmarks/disk_nixl_posix.py [--dir /mnt/nvme] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucm_ray.store.shard.disk.store import COALESCE_BYTES, READ_DEPTH  # noqa: E402
from ucm_ray.transport.nixl.agent import _nixl_api  # noqa: E402

log = logging.getLogger("disk_nixl_posix")
CHUNK = 32


class Nixl:
    """One agent with the POSIX backend in one mode, the buffer and the file registered."""

    def __init__(self, mode: str, buffer_addr: int, buffer_bytes: int, fd: int, file_bytes: int) -> None:
        api = _nixl_api()
        self.name = f"disk-probe-{mode}"
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=[]))
        self.agent.create_backend("POSIX", {f"use_{mode}": "true"})
        self.fd = fd
        self.regs = [self.agent.register_memory([(buffer_addr, buffer_bytes, 0, "")], "DRAM", backends=["POSIX"]),
                     self.agent.register_memory([(0, file_bytes, fd, "")], "FILE", backends=["POSIX"])]

    def read(self, extents: list[tuple[int, int, int]]) -> None:
        """``extents``: (file offset, size, buffer address), as one transfer."""
        local = self.agent.get_xfer_descs([(addr, size, 0) for _, size, addr in extents], "DRAM")
        remote = self.agent.get_xfer_descs([(off, size, self.fd) for off, size, _ in extents], "FILE")
        handle = self.agent.initialize_xfer("READ", local, remote, self.name, backends=["POSIX"])
        state = self.agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = self.agent.check_xfer_state(handle)
        self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise OSError(f"NIXL POSIX read failed ({state})")

    def close(self) -> None:
        for reg in self.regs:
            self.agent.deregister_memory(reg)


Chunks = list[list[tuple[int, int]]]
"""Per chunk, its entries' (file offset, size); an entry lands at its own offset of the buffer."""


class Ways:
    """The reads compared, over one file and one buffer."""

    def __init__(self, fd: int, buffer: mmap.mmap, nixl: dict[str, Nixl]) -> None:
        self.fd = fd
        self.view = memoryview(buffer)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        self.nixl = nixl
        self.threads = ThreadPoolExecutor(READ_DEPTH)

    def _read(self, offset: int, size: int) -> None:
        os.preadv(self.fd, [self.view[offset:offset + size]], offset)

    def preadv_1(self, chunks: Chunks) -> None:
        for chunk in chunks:
            for offset, size in chunk:
                self._read(offset, size)

    @staticmethod
    def coalesced(chunk: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The tier's reads of a chunk of adjacent entries: ``COALESCE_BYTES`` each, or one entry
        where that is larger."""
        start, end = chunk[0][0], chunk[-1][0] + chunk[-1][1]
        step = max(chunk[0][1], COALESCE_BYTES)
        return [(at, min(step, end - at)) for at in range(start, end, step)]

    def preadv_tier(self, chunks: Chunks) -> None:
        for chunk in chunks:
            reads = self.coalesced(chunk)
            list(self.threads.map(self._read, [at for at, _ in reads], [size for _, size in reads]))

    def through_nixl(self, mode: str, chunks: Chunks, coalesce: bool) -> None:
        for chunk in chunks:
            reads = self.coalesced(chunk) if coalesce else chunk
            self.nixl[mode].read([(offset, size, self.addr + offset) for offset, size in reads])

    def all(self) -> dict[str, Callable[[Chunks], None]]:
        ways: dict[str, Callable[[Chunks], None]] = {"preadv_1": self.preadv_1, "preadv_tier": self.preadv_tier}
        for mode in self.nixl:
            ways[f"nixl_{mode}"] = lambda chunks, mode=mode: self.through_nixl(mode, chunks, False)
            ways[f"nixl_{mode}_coalesced"] = lambda chunks, mode=mode: self.through_nixl(mode, chunks, True)
        return ways


def measure(ways: Ways, entry: int, total: int, rounds: int) -> None:
    """Every way in turn, ``rounds`` times, over the same chunks of ``entry``-byte entries."""
    chunks = [[(at, entry) for at in range(c, min(c + CHUNK * entry, total), entry)]
              for c in range(0, total, CHUNK * entry)]
    seconds: dict[str, list[float]] = {name: [] for name in ways.all()}
    for _ in range(rounds):
        for name, way in ways.all().items():
            started = time.perf_counter()
            way(chunks)
            seconds[name].append(time.perf_counter() - started)
    gbs = {name: total / statistics.median(s) / 1e9 for name, s in seconds.items()}
    log.info("entry %d KiB: %s", entry >> 10, ", ".join(
        f"{name} {g:.2f} GB/s ({total / max(seconds[name]) / 1e9:.2f}-{total / min(seconds[name]) / 1e9:.2f})"
        for name, g in gbs.items()))
    best = max((g for name, g in gbs.items() if name.startswith("nixl")), default=0.0)
    tag = "" if entry == 2 << 20 else f"_{entry >> 10}k"
    print(f"nixl_vs_tier{tag}={best / gbs['preadv_tier']:.3f} "
          f"nixl_vs_preadv_1{tag}={best / gbs['preadv_1']:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk (not tmpfs)")
    parser.add_argument("--mib", type=int, default=256, help="bytes read per way and round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    total = args.mib << 20
    path = os.path.join(args.dir, f"nixl-probe-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_DIRECT, 0o600)
    buffer = mmap.mmap(-1, total)
    nixl: dict[str, Nixl] = {}
    try:
        os.posix_fallocate(fd, 0, total)
        for at in range(0, total, 4 << 20):  # distinct bytes, written once
            buffer[:4 << 20] = os.urandom(4 << 20)
            os.pwritev(fd, [memoryview(buffer)[:4 << 20]], at)
        os.fsync(fd)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        for mode in ("aio", "uring"):
            try:
                nixl[mode] = Nixl(mode, addr, total, fd, total)
            except Exception as e:  # noqa: BLE001 -- report why this mode cannot run here
                log.warning("NIXL POSIX %s: unavailable here: %s", mode, e)
        ways = Ways(fd, buffer, nixl)
        for entry in (64 << 10, 2 << 20):
            measure(ways, entry, total, args.rounds)
        ways.threads.shutdown()
    finally:
        for way in nixl.values():
            way.close()
        os.close(fd)
        os.unlink(path)


if __name__ == "__main__":
    main()
