"""What a design cost per request and per node, and the summary row printed per design."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

INDEX_ENTRY_BYTES = 32
"""One index entry or removal on the wire: a 16-byte key, a node, a slot, a generation."""


@dataclass
class RequestTally:
    """One request's costs."""

    prompt_tokens: int = 0
    hit_tokens: int = 0
    lookup_calls: int = 0
    """Distinct remote shards asked by the lookup (same-node answers are free: published index)."""
    touched: set[int] = field(default_factory=set)
    """Remote nodes this request's lookup, loads and saves reached."""
    save_off_bytes: int = 0
    load_off_bytes: int = 0
    copy_bytes: int = 0
    """Bytes a reader wrote into its own pool as a replica of what it loaded ((d), (e))."""
    index_msgs: int = 0
    index_bytes: int = 0
    stale: int = 0
    """Index entries that named a location whose pool no longer held the key (a wasted read)."""


@dataclass
class DesignStats:
    """Accumulated over a run: per request and per node."""

    nodes: int
    lookup_calls: list[int] = field(default_factory=list)
    touched: list[int] = field(default_factory=list)
    save_off: list[int] = field(default_factory=list)
    load_off: list[int] = field(default_factory=list)
    copy_bytes: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    index_msgs: int = 0
    index_bytes: int = 0
    stale: int = 0
    calls_received: np.ndarray = field(init=False)
    """Per node: lookup calls and index messages it answered."""
    bytes_served: np.ndarray = field(init=False)
    """Per node: bytes it sent to other nodes' readers."""

    def __post_init__(self) -> None:
        self.calls_received = np.zeros(self.nodes)
        self.bytes_served = np.zeros(self.nodes)

    def add(self, tally: RequestTally) -> None:
        self.lookup_calls.append(tally.lookup_calls)
        self.touched.append(len(tally.touched))
        self.save_off.append(tally.save_off_bytes)
        self.load_off.append(tally.load_off_bytes)
        self.copy_bytes += tally.copy_bytes
        self.prompt_tokens += tally.prompt_tokens
        self.hit_tokens += tally.hit_tokens
        self.index_msgs += tally.index_msgs
        self.index_bytes += tally.index_bytes
        self.stale += tally.stale

    def message(self, node: int, tally: RequestTally, entries: int, sender: int) -> None:
        """An index message of ``entries`` entries from ``sender`` to ``node`` (free when same node)."""
        if node == sender or entries <= 0:
            return
        self.calls_received[node] += 1
        tally.index_msgs += 1
        tally.index_bytes += entries * INDEX_ENTRY_BYTES


@dataclass
class Movement:
    """Keys moved or lost when one node leaves or joins, in units of 1/N of the keys."""

    leave_mean: float
    leave_worst: float
    join_mean: float
    index_worst: float = 0.0
    """The worst node's leave: index entries re-homed, in 1/N of the entries."""
    lost_worst: float = 0.0
    """The worst node's leave: keys whose only copy it held, in 1/N of the keys."""


@dataclass
class Row:
    design: str
    calls_p50: float
    calls_p99: float
    touched_mean: float
    save_off_mib: float
    load_off_mib: float
    copy_mib: float
    hot_calls: float
    hot_bytes: float
    leave_mean: float
    leave_worst: float
    join_mean: float
    index_worst: float
    lost_worst: float
    hit_rate: float
    hit_delta_points: float
    index_msgs: float
    index_kib: float
    stale_per_req: float

    @property
    def hot_spot(self) -> float:
        """The worse of the two hot-spot ratios (calls received, bytes served)."""
        return max(self.hot_calls, self.hot_bytes)


def _hot(per_node: np.ndarray) -> float:
    """Hottest node over the mean of all nodes (0 when nothing was received)."""
    mean = float(per_node.mean())
    return float(per_node.max()) / mean if mean else 0.0


def summarise(name: str, stats: DesignStats, moved: Movement, baseline_hit: float | None) -> Row:
    requests = max(len(stats.lookup_calls), 1)
    hit = stats.hit_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
    return Row(design=name,
               calls_p50=float(np.percentile(stats.lookup_calls, 50)),
               calls_p99=float(np.percentile(stats.lookup_calls, 99)),
               touched_mean=float(np.mean(stats.touched)),
               save_off_mib=float(np.mean(stats.save_off)) / 2**20,
               load_off_mib=float(np.mean(stats.load_off)) / 2**20,
               copy_mib=stats.copy_bytes / requests / 2**20,
               hot_calls=_hot(stats.calls_received), hot_bytes=_hot(stats.bytes_served),
               leave_mean=moved.leave_mean, leave_worst=moved.leave_worst, join_mean=moved.join_mean,
               index_worst=moved.index_worst, lost_worst=moved.lost_worst,
               hit_rate=hit, hit_delta_points=100 * (hit - (hit if baseline_hit is None else baseline_hit)),
               index_msgs=stats.index_msgs / requests, index_kib=stats.index_bytes / requests / 1024,
               stale_per_req=stats.stale / requests)


HEADER = ("design", "calls p50", "calls p99", "touched", "save off MiB", "load off MiB", "copy MiB",
          "hot calls", "hot bytes", "leave mean", "leave worst", "join mean",
          "leave idx worst", "leave lost worst", "hit %", "d hit pts",
          "idx msgs", "idx KiB", "stale")


def format_table(rows: list[Row]) -> list[str]:
    """A markdown table, one row per design."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for row in rows:
        cells = [row.design, f"{row.calls_p50:.0f}", f"{row.calls_p99:.0f}", f"{row.touched_mean:.1f}",
                 f"{row.save_off_mib:.1f}", f"{row.load_off_mib:.1f}", f"{row.copy_mib:.1f}",
                 f"{row.hot_calls:.1f}", f"{row.hot_bytes:.1f}",
                 f"{row.leave_mean:.2f}", f"{row.leave_worst:.2f}", f"{row.join_mean:.2f}",
                 f"{row.index_worst:.2f}", f"{row.lost_worst:.2f}", f"{100 * row.hit_rate:.1f}",
                 f"{row.hit_delta_points:+.1f}", f"{row.index_msgs:.1f}", f"{row.index_kib:.1f}",
                 f"{row.stale_per_req:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
