"""Entry checksum speed: ``ucm_ray.store.checksum`` (XXH3-64, streamed) against CRC32 (``zlib``, the
checksum before it), measured in the same run on the same bytes, per entry size, two ways:

- ``whole``: one call per entry (the disk tier's write and read check, the store client's);
- ``segments``: the entry summed in ``--segments`` pieces (a worker's save or paranoid load sums an
  entry layer by layer: CRC32 chained over the pieces, ``Checksum.update`` for XXH3). The pieces
  are bfloat16, as a KV cache's are, so each one's conversion to bytes is in the figure.

Each figure is the median of ``--rounds`` passes over ``--mib`` MiB of distinct entries (larger than
the caches, as pool entries are). Last line: ``checksum_vs_crc32=`` (2 MiB entries, whole).

Run: ``python benchmarks/checksum.py [--mib 256 --rounds 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import zlib
from collections.abc import Callable

import torch

from ucm_ray.store.checksum import Checksum, checksum

SIZES = {"64k": 64 << 10, "2m": 2 << 20}


def crc32(t: torch.Tensor, value: int = 0) -> int:
    """The checksum before this one, as it was: CRC32 continuing from ``value``."""
    data = t.detach()
    if data.is_cuda:
        data = data.cpu()
    return zlib.crc32(memoryview(data.contiguous().view(-1).view(torch.uint8).numpy()), value)


def crc32_segments(parts: list[torch.Tensor]) -> int:
    value = 0
    for p in parts:
        value = crc32(p, value)
    return value


def xxh3_segments(parts: list[torch.Tensor]) -> int:
    running = Checksum()
    for p in parts:
        running.update(p)
    return running.value()


def gbps(fn: Callable[[torch.Tensor], object], entries: list, rounds: int) -> float:
    nbytes = sum(sum(p.numel() for p in e) if isinstance(e, list) else e.numel() for e in entries)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for e in entries:
            fn(e)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="bytes summed per pass (distinct entries)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--segments", type=int, default=64, help="pieces per entry in the segmented figures")
    args = ap.parse_args()
    data = torch.randint(0, 256, (args.mib << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    ratio = 0.0
    for name, size in SIZES.items():
        entries = list(data.split(size))
        cut = [list(e.view(torch.bfloat16).split(max(1, size // 2 // args.segments))) for e in entries]
        assert all(xxh3_segments(c) == checksum(e) for c, e in zip(cut[:4], entries[:4]))
        old, new = gbps(crc32, entries, args.rounds), gbps(checksum, entries, args.rounds)
        old_seg, new_seg = gbps(crc32_segments, cut, args.rounds), gbps(xxh3_segments, cut, args.rounds)
        print(f"{name}: whole crc32 {old:.2f} GB/s, xxh3 {new:.2f} GB/s (x{new / old:.1f}); "
              f"{args.segments} segments crc32 {old_seg:.2f} GB/s, xxh3 {new_seg:.2f} GB/s (x{new_seg / old_seg:.1f})",
              flush=True)
        if name == "2m":
            ratio = new / old
    print(f"checksum_vs_crc32={ratio:.2f}")


if __name__ == "__main__":
    main()
