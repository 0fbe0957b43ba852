"""The disk tier's manifest: which slot of which data file holds which key, as of one generation.

A compact binary record rather than JSON: a tier 10x a 64 GiB pool holds ~320k 2 MiB entries,
and the manifest is rewritten at every checkpoint. Layout (little-endian): a header (magic,
version, file count, bytes per file, generation, record count), one record per entry (key
length, file, offset, size, checksum of the entry's bytes, the generation that wrote it, the key),
then a checksum of everything before it, so a manifest damaged at rest reads as absent, never as
a list of wrong slots. Records are in LRU order, least recent first, so adoption restores the order.

Version 2: checksums are ``store.checksum``'s (XXH3, 63 bits). A version-1 manifest (CRC32s)
is refused whole, by its header, before its records are read: its entries are not adopted
(their slots are free again), never checked against the wrong sum.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

MAGIC = b"UCMDISK\x01"
VERSION = 2
_HEADER = struct.Struct("<8sIIQQQ")
_RECORD = struct.Struct("<HHQQQQ")
_TRAILER = struct.Struct("<Q")


class ManifestError(ValueError):
    """The manifest is damaged, truncated or of another version: adopt nothing from it."""


@dataclass(frozen=True)
class DiskSlot:
    """Where one entry's bytes live on disk, and what they must checksum to."""

    file: int
    offset: int
    size: int
    checksum: int
    generation: int
    """The store generation that wrote it: never above the generation of a manifest listing it."""


@dataclass(frozen=True)
class Layout:
    files: int
    file_bytes: int


@dataclass(frozen=True)
class Manifest:
    layout: Layout
    generation: int
    entries: Sequence[tuple[bytes, DiskSlot]]


def encode(m: Manifest) -> bytes:
    parts = [_HEADER.pack(MAGIC, VERSION, m.layout.files, m.layout.file_bytes, m.generation, len(m.entries))]
    for key, s in m.entries:
        parts.append(_RECORD.pack(len(key), s.file, s.offset, s.size, s.checksum, s.generation))
        parts.append(key)
    body = b"".join(parts)
    return body + _TRAILER.pack(xxhash.xxh3_64_intdigest(body))


def decode(data: bytes) -> Manifest:
    if len(data) < _HEADER.size + _TRAILER.size:
        raise ManifestError(f"manifest of {len(data)} bytes is truncated")
    magic, version, files, file_bytes, generation, count = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise ManifestError(f"a version-{version} disk-tier manifest, not version {VERSION}" if magic == MAGIC
                            else "not a disk-tier manifest")
    body, (digest,) = data[:-_TRAILER.size], _TRAILER.unpack(data[-_TRAILER.size:])
    if xxhash.xxh3_64_intdigest(body) != digest:
        raise ManifestError("manifest checksum mismatch")
    at = _HEADER.size
    entries = []
    for _ in range(count):
        keylen, file, offset, size, checksum, gen = _RECORD.unpack_from(body, at)
        at += _RECORD.size
        key = bytes(body[at:at + keylen])
        at += keylen
        entries.append((key, DiskSlot(file, offset, size, checksum, gen)))
    if at != len(body):
        raise ManifestError("manifest length does not match its record count")
    return Manifest(Layout(files, file_bytes), generation, entries)
