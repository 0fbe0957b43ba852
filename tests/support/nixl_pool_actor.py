"""A stand-in shard for NIXL tests: a /dev/shm pool in a Ray actor, exported with NIXL."""

from __future__ import annotations


def pool_actor_class():
    """Defined in a function so Ray ships the class by value (the actor's process need not
    import this module)."""
    import ray

    @ray.remote(num_cpus=0)
    class PoolActor:
        """A stand-in shard: a /dev/shm pool, exported once with NIXL."""

        def __init__(self, nbytes: int) -> None:
            import os
            import uuid

            from ucm_ray.transport.nixl import NixlPoolExporter
            from ucm_ray.transport.shm import SharedPool

            self.shm = SharedPool(f"/dev/shm/ucmr-nixltest-{os.getpid()}-{uuid.uuid4().hex[:6]}", nbytes,
                                  create=True)
            self.path = self.shm.path
            self.pool = self.shm.tensor
            self.pool.zero_()  # fault the pages in now, not during the first transfer
            self.exporter = NixlPoolExporter(self.pool, f"ucmr-test-{uuid.uuid4().hex[:8]}")

        def descriptor(self, shard_id: str = "s0", incarnation: int = 0):
            return self.exporter.descriptor(shard_id, ray.get_runtime_context().get_node_id(), self.path,
                                            incarnation=incarnation)

        def digests(self, ranges: list[tuple[int, int]]) -> list[str]:
            import hashlib

            return [hashlib.sha256(self.pool[o:o + n].numpy().tobytes()).hexdigest() for o, n in ranges]

        def read(self, offset: int, nbytes: int) -> bytes:
            return self.pool[offset:offset + nbytes].numpy().tobytes()

        def fill(self, offset: int, nbytes: int, seed: int) -> None:
            import torch

            g = torch.Generator().manual_seed(seed)  # same bytes as torch.randint(0, 256, ...) with it
            self.pool[offset:offset + nbytes] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)

        def write(self, offset: int, data: bytes) -> None:
            import torch

            self.pool[offset:offset + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)

        def close(self) -> None:
            self.exporter.close()
            self.exporter = None
            self.pool = None
            self.shm.close()

    return PoolActor
