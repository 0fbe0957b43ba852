"""The capacity tier behind a shard's pool: preallocated files on local disk or a shared file system."""

from ucm_ray.store.shard.disk.fileops import FileOps
from ucm_ray.store.shard.disk.store import DiskInUse, DiskStats, DiskStore

__all__ = ["DiskInUse", "DiskStats", "DiskStore", "FileOps"]
