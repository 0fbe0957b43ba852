"""Which shards own a key: rendezvous (highest-random-weight) hashing.

Rendezvous hashing moves only ~1/N of the keys when a shard joins or leaves,
needs no ring state beyond the member list, and gives a natural replica order
(top-r scores). Keys are digests (see ``ucm_ray.keys``), so their first eight
bytes are already uniform; mixing them with a per-shard salt through
splitmix64 is vectorised with numpy, so placing 10,000 keys costs well under a
millisecond rather than one Python hash call per key and shard.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SHIFTS = (np.uint64(30), np.uint64(27), np.uint64(31))


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 of every element of the (non-scalar) uint64 array ``x``, in place on one
    temporary: array arithmetic wraps without a warning, so no ``errstate`` (with it and a new
    array per operation, the few keys a scheduler places per save took ~19 us here, now ~7)."""
    z = x + _GOLDEN
    z ^= z >> _SHIFTS[0]
    z *= _M1
    z ^= z >> _SHIFTS[1]
    z *= _M2
    z ^= z >> _SHIFTS[2]
    return z


def shard_salt(shard_id: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.blake2b(shard_id.encode(), digest_size=8).digest(), "little"))


def key_words(keys: Sequence[bytes]) -> np.ndarray:
    """First eight bytes of each key as uint64 (keys shorter than 8 bytes are rejected)."""
    lengths = set(map(len, keys))
    if len(lengths) == 1:  # the usual case, keys of one digest size: one join, no slice per key
        (length,) = lengths
        if length % 8 == 0:
            return np.frombuffer(b"".join(keys), dtype="<u8")[:: length // 8]
    if lengths and min(lengths) < 8:
        raise ValueError("store keys must be digests of at least 8 bytes (see ucm_ray.keys)")
    return np.frombuffer(b"".join(k[:8] for k in keys), dtype="<u8")


@functools.lru_cache(maxsize=64)
def _salts(shard_ids: tuple[str, ...]) -> np.ndarray:
    """Each shard's salt (a membership's, computed once: a lookup places keys every step)."""
    salts = np.array([shard_salt(s) for s in shard_ids], dtype=np.uint64)
    salts.setflags(write=False)
    return salts


def owners(keys: Sequence[bytes], shard_ids: Sequence[str], replication: int) -> np.ndarray:
    """``[len(keys), min(replication, len(shard_ids))]`` indices into ``shard_ids``,
    best-scoring first (index 0 is the primary)."""
    if not shard_ids:
        return np.zeros((len(keys), 0), dtype=np.int64)
    r = min(replication, len(shard_ids))
    words = key_words(keys)
    salts = _salts(tuple(shard_ids))
    scores = _splitmix64(words[:, None] ^ salts[None, :])
    if r == 1:  # the primary only (no replicas, the default): a quarter of a row sort's cost
        return np.argmax(scores, axis=1)[:, None]
    return np.argsort(scores, axis=1)[:, ::-1][:, :r]


def writer_owners(keys: Sequence[bytes], shard_ids: Sequence[str], local: Sequence[bool],
                  replication: int) -> np.ndarray:
    """Writer-local placement (``placement: writer_local``): as ``owners``, but the primary is
    the best-scoring shard on the writer's node (``local``: per shard, whether it is there) and
    the other ``replication - 1`` are the best-scoring shards elsewhere, so a save leaves its
    node only when replication asks for it. Where every shard or none is local this is
    ``owners`` itself: one node places exactly as before."""
    local_at = np.flatnonzero(np.asarray(local, dtype=bool))
    if len(local_at) in (0, len(shard_ids)):
        return owners(keys, shard_ids, replication)
    remote_at = np.flatnonzero(~np.asarray(local, dtype=bool))
    primary = local_at[owners(keys, [shard_ids[i] for i in local_at.tolist()], 1)]
    extra = min(replication, len(shard_ids)) - 1
    if extra <= 0:
        return primary
    others = remote_at[owners(keys, [shard_ids[i] for i in remote_at.tolist()], extra)]
    return np.concatenate([primary, others], axis=1)


def copy_bound(nodes: int, nodes_per_pool: int) -> int:
    """Pools a block may be held by before readers stop copying it (``copy_nodes_per_pool``): one
    per ``nodes_per_pool`` nodes of the fleet, rounded up; 0: no bound. Here, not with the
    engine's reads: the directory's hot-prefix table keeps to the same bound."""
    return -(-nodes // nodes_per_pool) if nodes_per_pool > 0 else 0
