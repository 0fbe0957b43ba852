"""A stand-in shard for remote index tests: a pool and its published index in /dev/shm, in a
Ray actor, exported with NIXL (``NixlPoolExporter``)."""

from __future__ import annotations

POOL = 16 << 20
INCARNATION = 0x5EED


def index_actor_class():
    """Defined in a function so Ray ships the class by value (the actor's process need not
    import this module)."""
    import ray

    @ray.remote(num_cpus=0)
    class IndexActor:
        """A stand-in shard: a pool and its published index, exported with NIXL."""

        def __init__(self, path: str) -> None:
            import uuid

            import torch

            from ucm_ray.store.shard.published_writer import PublishedIndex
            from ucm_ray.transport.nixl import NixlPoolExporter
            from ucm_ray.transport.shm import SharedPool

            self.shm = SharedPool(path, POOL, create=True)
            self.table = PublishedIndex(path + "-index", POOL, INCARNATION)
            self.exporter = NixlPoolExporter(self.shm.tensor, f"ucmr-idx-{uuid.uuid4().hex[:8]}",
                                             index=torch.frombuffer(self.table.memory(), dtype=torch.uint8))

        def descriptor(self):
            import dataclasses

            desc = self.exporter.descriptor("s0", "another-node", self.shm.path, incarnation=INCARNATION)
            return dataclasses.replace(desc, index_path=self.table.path, index_base_addr=self.exporter.index_base_addr,
                                       index_bytes=self.exporter.index_bytes)

        def publish(self, keys: list[bytes], offsets: list[int]) -> list[int]:
            return [self.table.publish(k, off, 4096, None) for k, off in zip(keys, offsets)]

        def unpublish(self, keys: list[bytes]) -> None:
            for k in keys:
                self.table.unpublish(k)

        def close(self) -> None:
            self.exporter.close()
            self.exporter = None
            self.table.close()
            self.shm.close()

    return IndexActor
