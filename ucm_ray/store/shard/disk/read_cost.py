"""What a promotion's reads cost: seconds = a fixed part + bytes / a rate, fitted to the chunks read.

Why not bytes per second alone: every read costs something besides its bytes (system calls,
the reader threads' hand-off, the index calls of its chunk, the disk's own latency: tens of
milliseconds a read on a network file system). A one-key lookup measured a bytes/s far below
what a long prompt's chunk reads at, and averaged in, the small lookups of a conversation's later
turns made the tier cut keys that its wait would have read, or read none against
``disk_recompute_bytes_s``. Fitted to chunks of different sizes, the two parts predict a small
chunk and a large one alike. Until two sizes are seen, the fit goes through zero (bytes/s).
"""

from __future__ import annotations

from dataclasses import dataclass

SAME_SIZE = 1e-6
"""Chunk sizes whose spread is below this share of their mean give no fixed part: bytes/s."""


@dataclass
class ReadCost:
    """Exponentially weighted least squares of (bytes, seconds) per chunk read."""

    weight: float
    """The newest chunk's weight: a few chunks follow a change of load."""
    samples: int = 0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        """One chunk's reads: ``nbytes`` in ``seconds`` (nothing read, or no time: ignored)."""
        if nbytes <= 0 or seconds <= 0:
            return
        w = 1.0 if self.samples == 0 else self.weight
        self._x += w * (nbytes - self._x)
        self._y += w * (seconds - self._y)
        self._xx += w * (nbytes * nbytes - self._xx)
        self._xy += w * (nbytes * seconds - self._xy)
        self.samples += 1

    def fit(self) -> tuple[float, float]:
        """(fixed seconds a chunk, seconds a byte), both >= 0; (0, 0) before any sample."""
        if not self.samples:
            return 0.0, 0.0
        spread = self._xx - self._x * self._x
        if spread <= SAME_SIZE * self._x * self._x:
            return 0.0, self._y / self._x
        slope = (self._xy - self._x * self._y) / spread
        if slope <= 0:  # larger chunks were no slower: a fixed cost a chunk, whatever its size
            return self._y, 0.0
        fixed = self._y - slope * self._x
        if fixed < 0:  # no fixed part: the best line through zero
            return 0.0, self._xy / self._xx
        return fixed, slope

    def seconds(self, nbytes: int) -> float:
        """Predicted seconds to read a chunk of ``nbytes``."""
        fixed, per_byte = self.fit()
        return fixed + per_byte * nbytes
