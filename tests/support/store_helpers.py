"""Deterministic block contents and a client that runs in another process (a Ray actor)."""

from __future__ import annotations

import hashlib
import os
import signal
import time

import ray
import torch

from ucm_ray.store.shard.fleet import shard_name, start_fleet
from ucm_ray.store.types import DIRECTORY_NAME

SIZES = (4096, 12288, 65536, 1000, 131072, 777)


def key(i: int, tag: str = "k") -> bytes:
    return hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=16).digest()


def block(i: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    return torch.randint(0, 256, (SIZES[i % len(SIZES)],), dtype=torch.uint8, generator=g)


def read_back(client, n: int, tag: str = "k") -> tuple[list[bool], list[torch.Tensor]]:
    """``client.get`` of blocks 0..n-1 of ``tag`` into a fresh, zeroed, registered buffer."""
    sizes = [SIZES[i % len(SIZES)] for i in range(n)]
    buf = torch.zeros(sum(sizes), dtype=torch.uint8)
    client.register_local(buf)
    views, off = [], 0
    for s in sizes:
        views.append(buf[off: off + s])
        off += s
    ok = client.get([key(i, tag) for i in range(n)], views)
    return ok, views


def arena(n: int, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One registered buffer holding blocks 0..n-1 back to back, plus views of each."""
    sizes = [SIZES[i % len(SIZES)] for i in range(n)]
    buf = torch.empty(sum(sizes), dtype=torch.uint8)
    views, off = [], 0
    for i, s in enumerate(sizes):
        views.append(buf[off: off + s])
        views[-1].copy_(block(i, seed))
        off += s
    return buf, views


@ray.remote(num_cpus=0)
class ClientProcess:
    """A StoreClient living in its own worker process."""

    def __init__(self, config: dict) -> None:
        from ucm_ray.config import UcmRayConfig
        from ucm_ray.store.engine.client import StoreClient

        self.client = StoreClient(UcmRayConfig.from_dict(config))

    def write(self, n: int, seed: int = 0, tag: str = "k") -> list[bool]:
        buf, views = arena(n, seed)
        self.client.register_local(buf)
        return self.client.put([key(i, tag) for i in range(n)], views)

    def transports(self) -> list[str]:
        return sorted({self.client.transport_kind(s) for s in self.client.membership.shard_ids})


def shard_pid(cfg, i: int) -> int:
    return ray.get(ray.get_actor(shard_name(i), namespace=cfg.ray_namespace).stats.remote(), timeout=30)["pid"]


def restart_shard(cfg, i: int) -> None:
    """kill -9 shard ``i``, wait until the directory saw it die, start the fleet again."""
    os.kill(shard_pid(cfg, i), signal.SIGKILL)
    directory = ray.get_actor(DIRECTORY_NAME, namespace=cfg.ray_namespace)
    deadline = time.monotonic() + 30
    while shard_name(i) in ray.get(directory.membership.remote(), timeout=10).shard_ids:
        assert time.monotonic() < deadline, "the directory never noticed the kill"
        time.sleep(0.1)
    start_fleet(cfg)
