"""One configuration (nodes, block size, router): the workload once, every design over it."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from benchmarks.scale.cluster import Cluster, Placement, owners_under, shard_ids
from benchmarks.scale.designs import DESIGNS, Design, DesignParams
from benchmarks.scale.metrics import Movement, Row, summarise
from benchmarks.scale.workload import BYTES_PER_TOKEN, Workload, WorkloadSpec

JOIN_TRIALS = 3
JOIN_SAMPLE = 20_000
"""Anchors placed under the grown membership per join trial (a sample, weighted by entries)."""


@dataclass
class ConfigResult:
    spec: WorkloadSpec
    pool_tokens: int
    unique_tokens: int
    rows: list[Row]
    evictions: dict[str, int]
    seconds: float


def pool_tokens_for(unique_tokens: int, nodes: int, pool_fraction: float, min_pool_tokens: int) -> int:
    """Per node: ``pool_fraction`` of the workload's distinct tokens spread over the nodes, and at
    least ``min_pool_tokens`` (a writer's node must hold a whole long prompt)."""
    return max(int(pool_fraction * unique_tokens / nodes), min_pool_tokens)


def movement(design: Design, cluster: Cluster) -> Movement:
    """Keys moved or lost when one node leaves (each node in turn) or a new one joins, in units
    of 1/N of the distinct keys held. A leave loses the data whose only copy was there (moved, for
    designs whose data follows its anchor: the same keys) and moves the index entries it owned.
    Split too: the index entries a leave re-homes (in 1/N of the entries) and the data it loses
    (in 1/N of the keys), each node's worst."""
    nodes = cluster.nodes
    copies: Counter[bytes] = Counter(key for held in cluster.stored for key in held)
    total = len(copies)
    if not total:
        return Movement(0.0, 0.0, 0.0)
    affected = np.zeros(nodes)
    lost = np.zeros(nodes)
    for node, held in enumerate(cluster.stored):
        affected[node] = lost[node] = sum(copies[key] == 1 for key in held)
    keys, anchors = design.entries()
    rehomed = np.zeros(nodes)
    if keys:
        anchor_home = cluster.placement.primary(anchors)
        np.add.at(rehomed, anchor_home, 1)
        for key, home in zip(keys, anchor_home.tolist()):
            if not (copies.get(key) == 1 and key in cluster.stored[home]):  # not counted as data already
                affected[home] += 1
    unit = total / nodes
    index_worst = float(rehomed.max() / (len(keys) / nodes)) if keys else 0.0
    return Movement(float(affected.mean() / unit), float(affected.max() / unit),
                    _join(design, cluster, keys, anchors) / unit, index_worst=index_worst,
                    lost_worst=float(lost.max() / unit))


def _join(design: Design, cluster: Cluster, keys: list[bytes], anchors: list[bytes]) -> float:
    """Mean entries whose anchor's owner becomes a new node (data too where it follows the anchor)."""
    if not anchors:
        return 0.0
    weight = Counter(anchors)
    unique = sorted(weight)
    rng = np.random.default_rng(len(unique))
    if len(unique) > JOIN_SAMPLE:
        unique = [unique[index] for index in rng.choice(len(unique), JOIN_SAMPLE, replace=False)]
    weights = np.array([weight[anchor] for anchor in unique], dtype=float)
    moved = []
    for trial in range(JOIN_TRIALS):
        ids = shard_ids(cluster.nodes) + [f"node-join-{trial}"]
        new_owner = owners_under(unique, ids) == cluster.nodes
        moved.append(float(weights[new_owner].sum() / weights.sum()) * len(keys))
    return float(np.mean(moved))


def run_config(spec: WorkloadSpec, params: DesignParams, pool_fraction: float, min_pool_tokens: int,
               progress: bool, designs: str = "") -> ConfigResult:
    """``designs``: the letters of the designs to run ((a), the hit rate's baseline, always runs);
    empty: all."""
    started = time.perf_counter()
    requests = Workload(spec).requests()
    unique_tokens = len({key for request in requests for key in request.keys}) * spec.block_size
    pool_tokens = pool_tokens_for(unique_tokens, spec.nodes, pool_fraction, min_pool_tokens)
    placement = Placement(shard_ids(spec.nodes))
    rows: list[Row] = []
    evictions: dict[str, int] = {}
    baseline: float | None = None
    for design_class in DESIGNS:
        if designs and design_class.name[0] not in designs + "a":
            continue
        cluster = Cluster(spec.nodes, pool_tokens * BYTES_PER_TOKEN, spec.block_bytes, placement)
        design = design_class(cluster, replace(params, seed=spec.seed))
        design.run(requests, progress=max(len(requests) // 4, 1) if progress else 0)
        row = summarise(design.name, design.stats, movement(design, cluster), baseline)
        if baseline is None:
            baseline = row.hit_rate
        rows.append(row)
        evictions[design.name] = cluster.evictions()
        if progress:
            logging.info("nodes=%d block=%d router=%s: %s done (%.0f s so far)", spec.nodes, spec.block_size,
                         spec.router, design.name, time.perf_counter() - started)
    return ConfigResult(spec, pool_tokens, unique_tokens, rows, evictions, time.perf_counter() - started)
