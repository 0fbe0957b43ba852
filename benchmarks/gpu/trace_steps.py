"""Per engine step, where the time of a traced decode batch goes: the host's or the device's.

Reads the Chrome traces ``gpu_decode_stall.py --trace-steps K`` writes (torch's profiler, the
engine's steps, our code and the device's kernels and copies) and prints, per engine, the
medians over its steps of:

- ``wall``: the engine core's ``step``;
- ``to_launch``: from the step's start to the forward's first launch on the host (a CUDA graph
  launch, else the first kernel launch): the host's serial work before the device can start;
- ``device_busy`` / ``device_idle``: the union of every kernel, copy and memset inside the step,
  and the rest of the step;
- ``side_streams``: device work on streams other than the forward's (ours: saves, loads);
- ``waits``: the engine thread inside a synchronize call (the host ahead of the device);
- ``ours_host``: the engine thread inside our code (``ucm_ray``), outermost calls only.

An engine whose steps are longer by about its extra ``ours_host`` and ``to_launch`` is slowed
by host time; one whose ``device_busy`` grew is slowed on the device.

    python benchmarks/trace_steps.py batch_A.trace.json.gz batch_C.trace.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

DEVICE_WORK = {"kernel", "gpu_memcpy", "gpu_memset"}
STEP = re.compile(r"engine/core\.py\(\d+\): step(_with_batch_queue)?$")
SYNCS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")
LAUNCHES = ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel")
COLUMNS = ("wall", "to_launch", "device_busy", "device_idle", "side_streams", "waits", "ours_host")


@dataclass(frozen=True)
class Span:
    start: float
    end: float


def _union(spans: list[Span], window: Span) -> float:
    """Microseconds of ``window`` covered by ``spans``."""
    clipped = sorted((max(s.start, window.start), min(s.end, window.end)) for s in spans
                     if s.end > window.start and s.start < window.end)
    covered, reach = 0.0, window.start
    for start, end in clipped:
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def _span(event: dict[str, Any]) -> Span:
    start = float(event["ts"])
    return Span(start, start + float(event.get("dur", 0.0)))


def step_rows(path: str) -> list[dict[str, float]]:
    """One row of ``COLUMNS`` (microseconds) per engine step in the trace at ``path``."""
    with gzip.open(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in events if e.get("cat") == "python_function" and STEP.search(e.get("name", ""))),
                   key=lambda e: e["ts"])
    if not steps:
        return []
    engine_thread = (steps[0]["pid"], steps[0]["tid"])
    device = [e for e in events if e.get("cat") in DEVICE_WORK]
    kernel_time: dict[Any, float] = defaultdict(float)
    for event in device:
        if event.get("cat") == "kernel":
            kernel_time[event.get("args", {}).get("stream")] += float(event.get("dur", 0.0))
    forward_stream = max(kernel_time, key=kernel_time.__getitem__) if kernel_time else None
    on_thread = [e for e in events if (e.get("pid"), e.get("tid")) == engine_thread]
    runtime = [e for e in on_thread if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    ours = [_span(e) for e in on_thread if e.get("cat") == "python_function" and "ucm_ray/" in e.get("name", "")]
    device_spans = [_span(e) for e in device]
    side = [_span(e) for e in device if e.get("args", {}).get("stream") != forward_stream]
    rows = []
    for step in steps:
        window = _span(step)
        launches = [float(e["ts"]) for e in runtime if e["name"] in LAUNCHES and window.start <= e["ts"] < window.end]
        rows.append({
            "wall": window.end - window.start,
            "to_launch": (min(launches) - window.start) if launches else float("nan"),
            "device_busy": _union(device_spans, window),
            "device_idle": window.end - window.start - _union(device_spans, window),
            "side_streams": _union(side, window),
            "waits": _union([_span(e) for e in runtime if e["name"] in SYNCS], window),
            "ours_host": _union(ours, window),
        })
    return rows


def summary(paths: dict[str, str]) -> str:
    """A table: per engine (label -> trace path), the median of each column over its steps."""
    medians = {}
    for label, path in paths.items():
        rows = step_rows(path)
        medians[label] = {c: statistics.median(r[c] for r in rows) for c in COLUMNS} if rows else {}
        medians[label]["steps"] = float(len(rows))
    lines = [f"{'median us per step':<20}" + "".join(f"{label:>12}" for label in paths)]
    for column in ("steps", *COLUMNS):
        lines.append(f"{column:<20}" + "".join(f"{medians[label].get(column, float('nan')):>12.1f}"
                                               for label in paths))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", help="trace files; each is labelled by its name (batch_A -> A)")
    args = ap.parse_args()
    labels = {re.sub(r"^batch_|\.trace\.json\.gz$", "", path.rsplit("/", 1)[-1]): path for path in args.traces}
    print(summary(labels))
