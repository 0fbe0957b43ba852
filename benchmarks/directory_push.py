"""Issue 40, stop 63: what a ~1 Hz push through the directory's long poll costs the directory.

A load-aware pick (docs/scaling.md, stop 63, helper loadpick17) would have the directory push a
per-pool load figure (~800 B: the top 100 pools) to every engine about once a second. Engines follow
the directory with one long poll each (``ShardDirectory.wait_for_change``, re-posted after every
answer, ``store.engine.feed.MembershipFeed``); today it answers only on a change (rare). This
measures what answering every waiting engine at 0.2 / 1 / 2 pushes a second costs the real actor.

How:
- The directory is the package's ``ShardDirectory``, created with the options ``fleet._start``
  gives it (named, detached, ``num_cpus=0``, ``max_restarts=-1``; ``max_concurrency`` is the
  class's own, ``directory.MAX_CALLS_AT_ONCE``, since this stop's measurement: it was Ray's default
  for an async actor, 1,000). ``fleet`` has no directory-only helper, so the options are repeated
  here.
- Two stand-in pools (tiny actors answering ``describe`` and ``wait_until_death``, the two calls
  the directory makes to a shard) register, so that hot-table rows can name member pools.
- A push is what a hot-table push is today: ``add_hot_prefix`` with ``--rows`` rows, each naming
  the other stand-in pool than the push before, so each push changes every row, bumps the version
  once and each answer carries those rows as a ``HotPrefixDelta`` (the answer's pickled size is
  logged; the default 57 rows add ~800 B to a one-row push's answer, the load figure's size).
  The package has no load figure to push: the hot table's delta is the real API that carries
  that many bytes per answer.
- ``--client-procs`` async Ray actors each run many simulated engines: one asyncio task per engine
  holding one ``wait_for_change(version, known_hot=revision, shards_held=True)`` call (what
  ``MembershipFeed.poll`` posts), re-posted on every answer with the answer's version and revision.
- Per run: every engine posts, the pushes go at the rate, and each engine stops when it holds the
  last version. Measured: the directory process's CPU seconds (``psutil`` on its pid) over the push
  phase, per second (``cpu_share``, 1.0 = one core busy) and per answer; the latency from the push's
  call to each engine's receipt of that version (p50, p99, max); versions an engine skipped (two
  pushes before it re-posted: it got the newer); and a ``ping`` to the directory once between
  pushes (its other calls wait behind the long polls when they fill ``max_concurrency``).
  The client processes share the box's cores with the directory: their CPU is logged too.

Run (CPU box, ~2 min)::

    env -u PYTHONPATH RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 \\
        nice .venv/bin/python benchmarks/directory_push.py --clients 100,500,900 --rates 0.2,1,2 --seconds 5

With Ray's default ``max_concurrency`` (``--max-concurrency 1000``, the package's before this
stop's fix) past 1,000 engines a push waited for long polls to time out (``LONG_POLL_S``, 30 s)
before it got in: ``--clients 1200`` / ``2000 --rates 1 --seconds 2 --min-pushes 2`` took 1-3 min
each. The package's own limit (no flag) lets more engines wait: ``--clients 2000,4000,8000 --rates 1``.

The last line, ``directory_push: clients=<n> rate_hz=<r> directory_cpu_share=<x> answer_ms_p99=<y>``,
is the largest run's.

Stop 64 (helper relay18): ``--engines-per-node 8`` runs every (clients, rate) twice in one run, the
engines polling the directory (``direct``) and then polling their node's relay (``relayed``: a
relay per 8 engines, ``store.membership_relay.RelayedMembership`` as a shard holds it, each
following the directory with one long poll), and prints the directory's CPU per push and the
push-to-engine latency of both with their ratios. The relays run in ``--relay-procs`` async actors
(many relays each; a shard serves its engines' polls from threads of its relay group instead):
the relay hop is a Ray call, as on a node, but they share this box's cores with everything else::

    ... nice .venv/bin/python benchmarks/directory_push.py --clients 800,2000 --rates 1 --seconds 5 \\
        --engines-per-node 8

Stop 65 (helper loadpush19): ``--load-figure`` adds a third run per (clients, rate), ``relayed+load``:
the pools' load figure (``store.pool_load``) is what is pushed. ``--pools`` (100) pools are members
(one stand-in actor registered under each name); every engine's poll carries its reads of
``REPORT_POOLS`` pools (which three moves with the version it holds, so each period's reports move
the figure), its relay sums its engines' and sends them with its own poll ``REPORTS_GATHER_S`` after
an answer, as a shard's relay does; the directory's own pushes of the figure (paced, ~1 a second,
``PushPacer``) are the pushes, each answer carrying the ``TOP_POOLS`` figures; no hot-table push.
Compared with the ``relayed`` run's hot-table pushes (the same answers, without reports or
figures): the directory's and the relays' CPU per push. The first push is a hot-table push (it
answers the relays' polls, posted before any report: in a quiet fleet reports wait for the next
version or ``LONG_POLL_S``); later pushes' latency is from the first engine's receipt of the version
(the directory's bump is not timed from outside)::

    ... nice .venv/bin/python benchmarks/directory_push.py --clients 800 --rates 1 --seconds 6 \\
        --engines-per-node 8 --load-figure
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pickle
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil
import ray

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.measure import local_ray  # noqa: E402
from ucm_ray.config import UcmRayConfig  # noqa: E402
from ucm_ray.store.membership_relay import LONG_POLL_S, REPORTS_GATHER_S, RelayedMembership  # noqa: E402
from ucm_ray.store.pool_load import PoolReads  # noqa: E402
from ucm_ray.store.shard.directory import MAX_CALLS_AT_ONCE, ShardDirectory  # noqa: E402
from ucm_ray.store.types import DIRECTORY_NAME, Membership  # noqa: E402
from ucm_ray.transport.base import PoolDescriptor  # noqa: E402

log = logging.getLogger("directory_push")

STAND_IN_POOLS = ("pushcost_pool_a", "pushcost_pool_b")
"""Not ``SHARD_PREFIX``-named: the directory's rediscovery at its first call must not adopt them."""
REPORT_POOLS = 3
"""Pools an engine's report names (``--load-figure``; the simulation's 1,000-node reports: ~2.8)."""
REPORT_BYTES = 1 << 20
DEFAULT_ROWS = 57
"""Rows per push: ~14 B a row pickled, so an answer carries ~800 B more than a one-row push's (the
load figure's size: 100 pools x 8 B)."""


@ray.remote(num_cpus=0)
class StandInPool:
    """Answers the two calls the directory makes to a registering shard, and holds no pool: its
    ``describe`` names each of ``names`` in turn (one actor registered as many pools)."""

    def __init__(self, names: list[str]) -> None:
        self._names = list(names)

    async def describe(self) -> PoolDescriptor:
        return PoolDescriptor(shard_id=self._names.pop(0), node_id="node", pool_bytes=0, shm_path=None,
                              nixl_agent=None, nixl_metadata=None, pool_base_addr=0, incarnation=1)

    async def wait_until_death(self) -> None:
        await asyncio.Event().wait()  # never returns: the directory's death watch

    async def shutdown(self) -> None:
        return None


@ray.remote(num_cpus=0, max_concurrency=MAX_CALLS_AT_ONCE)
class RelayHost:
    """Many nodes' relays in one process: each follows the directory with one long poll (as a
    shard's ``MembershipRelay`` thread does) and answers its engines' polls from its
    ``RelayedMembership``, an asyncio wait in place of a shard's relay-group thread."""

    def __init__(self) -> None:
        self._relays: dict[int, RelayedMembership] = {}
        self._moved: dict[int, asyncio.Event] = {}
        self._followers: list[asyncio.Task] = []
        self._reads: dict[int, PoolReads] = {}
        """Per relay, its engines' reports since its last poll (``--load-figure``)."""
        self.posted = 0

    async def follow(self, directory: ray.actor.ActorHandle, relay_ids: list[int], last_version: int) -> None:
        """Start following; returns once every relay holds the directory's membership. Each stops
        once it holds ``last_version`` (no poll left waiting at the directory after the run)."""
        for relay_id in relay_ids:
            self._relays[relay_id] = RelayedMembership()
            self._reads[relay_id] = PoolReads()
            self._moved[relay_id] = asyncio.Event()
            self._followers.append(asyncio.create_task(self._follow(directory, relay_id, last_version)))
        while not all(self._relays[r].following for r in relay_ids):
            await asyncio.sleep(0.05)

    async def _follow(self, directory: ray.actor.ActorHandle, relay_id: int, last_version: int) -> None:
        state = self._relays[relay_id]
        reported = False
        while state.version != last_version:
            if reported:
                await asyncio.sleep(REPORTS_GATHER_S)  # as a shard's relay: its engines' reports of the push
            version, hot = state.poll_args()
            reads = self._reads[relay_id].drain()
            reported = reported or reads is not None
            answer = await directory.wait_for_change.remote(version, LONG_POLL_S, known_hot=hot, shards_held=True,
                                                            pool_reads=reads)
            state.take(answer, version)
            moved, self._moved[relay_id] = self._moved[relay_id], asyncio.Event()
            moved.set()

    async def wait_for_change(self, relay_id: int, known_version: int, timeout_s: float = LONG_POLL_S,
                              known_hot: int = -1, shards_held: bool = False,
                              pool_reads: dict[tuple[str, int], int] | None = None) -> Membership | None:
        self.posted += 1
        if pool_reads:
            self._reads[relay_id].add(pool_reads)
        state = self._relays[relay_id]
        if state.version == known_version:
            try:
                await asyncio.wait_for(self._moved[relay_id].wait(), timeout=timeout_s)
            except asyncio.TimeoutError:
                pass
        return state.answer(known_version, known_hot, shards_held)

    async def polls_posted(self) -> int:
        return self.posted

    async def cpu_s(self) -> float:
        return time.process_time()


@ray.remote(num_cpus=0)
class PollClient:
    """Many simulated engines in one process: one outstanding long poll each, re-posted on every
    answer as ``MembershipFeed.poll`` does."""

    async def run(self, directory: ray.actor.ActorHandle, engines: int, version: int, hot_revision: int,
                  last_version: int, relays: list[tuple[ray.actor.ActorHandle, int]] | None = None,
                  report_pools: list[tuple[str, int]] | None = None) -> dict[str, Any]:
        """Returns, per version, the monotonic receipt times; the answers' pickled sizes (first
        answer of each push); versions skipped; this process's CPU seconds meanwhile. ``relays``:
        per engine, its node's relay (host, relay id) to poll instead of the directory;
        ``report_pools``: each poll reports reads of ``REPORT_POOLS`` of them (``--load-figure``)."""
        receipts: dict[int, list[float]] = {}
        sizes: dict[int, int] = {}
        skipped = 0
        cpu_start = time.process_time()

        async def engine(number: int, relay: tuple[ray.actor.ActorHandle, int] | None) -> None:
            nonlocal skipped
            known, known_hot = version, hot_revision
            while known < last_version:
                report = None
                if report_pools:  # which pools moves with the version: each period's reports move the figure
                    first = (known * 7 + number) % len(report_pools)
                    report = {report_pools[(first + j) % len(report_pools)]: REPORT_BYTES for j in range(REPORT_POOLS)}
                if relay is not None:
                    host, relay_id = relay
                    answer: Membership | None = await host.wait_for_change.remote(
                        relay_id, known, known_hot=known_hot, shards_held=True, pool_reads=report)
                    if answer is None:
                        raise RuntimeError(f"relay {relay_id} behind an engine at version {known}")
                else:
                    answer = await directory.wait_for_change.remote(known, known_hot=known_hot, shards_held=True)
                now = time.monotonic()
                if answer.version == known:
                    continue  # the long poll's timeout: re-posted
                skipped += answer.version - known - 1
                receipts.setdefault(answer.version, []).append(now)
                if answer.version not in sizes:
                    sizes[answer.version] = len(pickle.dumps(answer))
                known = answer.version
                known_hot = answer.hot_delta.revision if answer.hot_delta is not None else answer.hot.revision

        await asyncio.gather(*(engine(i, relays[i] if relays else None) for i in range(engines)))
        return {"receipts": receipts, "sizes": sizes, "skipped": skipped,
                "cpu_s": time.process_time() - cpu_start}


@dataclass
class RunResult:
    mode: str
    """``direct`` (engines poll the directory) or ``relayed`` (their node's relay)."""
    clients: int
    rate_hz: float
    pushes: int
    answers: int
    answers_per_s: float
    directory_cpu_share: float
    directory_cpu_us_per_answer: float
    clients_cpu_share: float
    answer_ms_p50: float
    answer_ms_p99: float
    answer_ms_max: float
    skipped: int
    answer_bytes: int
    ping_ms_max: float
    busiest_thread_share: float
    """The directory process's busiest thread's CPU over the push phase (its event loop's, when that
    is the busiest): what one actor's single loop can at most take is 1.0."""
    push_call_ms_max: float
    """``add_hot_prefix``'s round trip: past ``max_concurrency`` long polls it waits for a free slot."""
    directory_answers: int = 0
    """Long polls the directory answered for the pushes (engines', or relays'): one each a push."""
    directory_cpu_ms_per_push: float = 0.0
    relays_cpu_share: float = 0.0
    """The relays' processes' CPU over the push phase (all relays together; 0: direct)."""
    relays_cpu_ms_per_push: float = 0.0


def start_directory(namespace: str, max_concurrency: int | None = None) -> ray.actor.ActorHandle:
    """The package's directory with ``fleet._start``'s options (no shards of its own);
    ``max_concurrency``: another limit than the class's (``directory.MAX_CALLS_AT_ONCE``), e.g.
    Ray's default of 1,000, which the package had before this stop, to see that wall again."""
    config = UcmRayConfig(ray_namespace=namespace, num_shards=1)
    extra: dict[str, Any] = {"max_concurrency": max_concurrency} if max_concurrency else {}
    return ShardDirectory.options(  # type: ignore[attr-defined]  # ray.remote classes
        name=DIRECTORY_NAME, namespace=namespace, lifetime="detached", get_if_exists=True, num_cpus=0,
        max_restarts=-1, **extra).remote(namespace, config.to_dict())


def push_rows(rows: int, pool: tuple[str, int]) -> dict[bytes, tuple[tuple[str, int], ...]]:
    """``rows`` hot-table rows, all naming ``pool`` (the next push names the other pool)."""
    return {b"L" + i.to_bytes(2, "big"): (pool,) for i in range(rows)}


def one_run(directory: ray.actor.ActorHandle, directory_process: psutil.Process, pollers: list[ray.actor.ActorHandle],
            clients: int, rate_hz: float, pushes: int, rows: int, pool_keys: list[tuple[str, int]],
            concurrency: int = MAX_CALLS_AT_ONCE, per_node: int = 0, relay_procs: int = 2,
            report_pools: list[tuple[str, int]] | None = None) -> RunResult:
    """``clients`` engines long-polling, ``pushes`` pushes at ``rate_hz``; ``per_node``: that many
    engines a node poll their node's relay (0: the directory); ``report_pools``: the engines report
    reads of these pools with every poll and the pushes are the directory's own, of the load figure
    (``rate_hz`` then only sets how many: its pacer's pace, ~1 a second; the first is a hot-table
    push, which answers the relays' polls posted before any report)."""
    state = ray.get(directory.ping.remote())
    version, hot_revision = state["version"], state["hot_revision"]
    last_version = version + pushes
    procs = len(pollers)
    per_proc = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    served_before = state["served"]["wait_for_change"]
    hosts: list[ray.actor.ActorHandle] = []
    engine_relays: list[list[tuple[ray.actor.ActorHandle, int]] | None] = [None] * procs
    if per_node:
        relays = -(-clients // per_node)
        hosts = [RelayHost.remote() for _ in range(min(relay_procs, relays))]  # type: ignore[attr-defined]
        ray.get([h.follow.remote(directory, list(range(i, relays, len(hosts))), last_version)
                 for i, h in enumerate(hosts)], timeout=120)
        first = 0
        for p, n in enumerate(per_proc):  # engine g of the fleet is on node g // per_node
            engine_relays[p] = [(hosts[(g // per_node) % len(hosts)], g // per_node) for g in range(first, first + n)]
            first += n
    runs = [p.run.remote(directory, n, version, hot_revision, last_version, engine_relays[i], report_pools)
            for i, (p, n) in enumerate(zip(pollers, per_proc)) if n]
    deadline = time.monotonic() + 30.0
    waiting = 0
    while time.monotonic() < deadline:  # every engine's first poll in (at most max_concurrency inside)
        if hosts:
            waiting = sum(ray.get([h.polls_posted.remote() for h in hosts]))
        else:
            waiting = ray.get(directory.ping.remote())["served"]["wait_for_change"] - served_before
        if waiting >= min(clients, concurrency):
            break
        time.sleep(0.2)
    time.sleep(0.5)
    log.info("clients=%d rate=%.1f Hz: %d long polls inside the directory; pushing %d times",
             clients, rate_hz, waiting, pushes)
    sent: dict[int, float] = {}
    pings: list[float] = []
    push_calls: list[float] = []
    cpu0 = directory_process.cpu_times()
    relays_cpu0 = sum(ray.get([h.cpu_s.remote() for h in hosts]))
    threads0 = {t.id: t.user_time + t.system_time for t in directory_process.threads()}
    start = time.monotonic()
    for i in range(1 if report_pools else pushes):  # the load figure: after one push the directory pushes it
        due = start + i / rate_hz
        time.sleep(max(0.0, due - time.monotonic()))
        t_sent = time.monotonic()
        pool_keys.reverse()  # every row names the other pool than the push before: all rows change
        new_version = ray.get(directory.add_hot_prefix.remote(push_rows(rows, pool_keys[0])))
        if new_version != version + i + 1:
            raise RuntimeError(f"push {i} moved the directory to version {new_version}, not {version + i + 1}")
        sent[new_version] = t_sent
        push_calls.append(time.monotonic() - t_sent)
        if i + 1 < pushes and (1 / rate_hz) > 0.3:  # one ping between pushes: the directory's other calls
            time.sleep(min(0.1, 0.25 / rate_hz))
            t_ping = time.monotonic()
            ray.get(directory.ping.remote())
            pings.append(time.monotonic() - t_ping)
    outcomes = ray.get(runs, timeout=240)
    end = time.monotonic()
    cpu1 = directory_process.cpu_times()
    # every poll posted was answered (each poller stops at the last version): a relay's first one
    # (it joined) is not the push's
    directory_answers = ray.get(directory.ping.remote())["served"]["wait_for_change"] - served_before - len(
        {relay for engines in engine_relays if engines for _, relay in engines})
    relays_cpu_s = sum(ray.get([h.cpu_s.remote() for h in hosts])) - relays_cpu0
    for host in hosts:
        ray.kill(host)
    threads1 = {t.id: t.user_time + t.system_time for t in directory_process.threads()}
    wall = end - start
    busiest_s = max(used - threads0.get(tid, 0.0) for tid, used in threads1.items())
    cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    if report_pools:  # from the first receipt of each version (the directory's bump is not seen)
        for v in range(version + 2, last_version + 1):
            sent[v] = min(t for o in outcomes for t in o["receipts"].get(v, ()))
    latencies = [t - sent[v] for o in outcomes for v, times in o["receipts"].items() for t in times]
    answers = len(latencies)
    lat_ms = np.array(latencies) * 1e3
    sizes = [s for o in outcomes for s in o["sizes"].values()]
    result = RunResult(
        mode=("relayed+load" if report_pools else "relayed") if per_node else "direct",
        directory_answers=directory_answers,
        directory_cpu_ms_per_push=cpu_s / pushes * 1e3, relays_cpu_share=relays_cpu_s / wall,
        relays_cpu_ms_per_push=relays_cpu_s / pushes * 1e3, clients=clients,
        rate_hz=rate_hz, pushes=pushes,
        answers=answers, answers_per_s=answers / wall,
        directory_cpu_share=cpu_s / wall, directory_cpu_us_per_answer=cpu_s / max(answers, 1) * 1e6,
        busiest_thread_share=busiest_s / wall, clients_cpu_share=sum(o["cpu_s"] for o in outcomes) / wall,
        answer_ms_p50=float(np.percentile(lat_ms, 50)), answer_ms_p99=float(np.percentile(lat_ms, 99)),
        answer_ms_max=float(lat_ms.max()), skipped=sum(o["skipped"] for o in outcomes),
        answer_bytes=int(np.median(sizes)) if sizes else 0, ping_ms_max=max(pings, default=0.0) * 1e3,
        push_call_ms_max=max(push_calls, default=0.0) * 1e3)
    log.info("%s: %d directory answers, %.1f ms of its CPU a push; relays' cpu %.3f core, %.1f ms a push", result.mode,
             directory_answers, result.directory_cpu_ms_per_push, result.relays_cpu_share,
             result.relays_cpu_ms_per_push)
    log.info("clients=%d rate=%.1f Hz: %d answers in %.1f s (%.0f/s), skipped %d; directory cpu %.3f core "
             "(%.0f us/answer, busiest thread %.3f), clients' cpu %.2f core; answer ms p50 %.1f p99 %.1f max %.1f; "
             "%d B an answer; ping ms max %.1f; push call ms max %.0f",
             clients, rate_hz, answers, wall, result.answers_per_s, result.skipped,
             result.directory_cpu_share, result.directory_cpu_us_per_answer, result.busiest_thread_share,
             result.clients_cpu_share,
             result.answer_ms_p50, result.answer_ms_p99, result.answer_ms_max, result.answer_bytes,
             result.ping_ms_max, result.push_call_ms_max)
    return result


def run_all(clients: list[int], rates: list[float], seconds: float, min_pushes: int, client_procs: int,
            rows: int, max_concurrency: int | None = None, per_node: int = 0, relay_procs: int = 2,
            load_pools: int = 0) -> list[RunResult]:
    """Every (clients, rate) on one directory (its version and table carry over between runs);
    ``per_node``: each also relayed, that many engines to a relay, right after the direct run;
    ``load_pools``: and relayed with the load figure (``--load-figure``) over that many member pools."""
    namespace = f"pushcost_{uuid.uuid4().hex[:8]}"
    directory = start_directory(namespace, max_concurrency)
    names = list(STAND_IN_POOLS) + [f"pushcost_pool_{i}" for i in range(max(0, load_pools - len(STAND_IN_POOLS)))]
    pools = [StandInPool.options(namespace=namespace).remote(names)]  # type: ignore[attr-defined]
    pollers = [PollClient.remote() for _ in range(client_procs)]  # type: ignore[attr-defined]
    try:
        for name in names:
            ray.get(directory.register.remote(name, pools[0]))
        pool_keys = [(name, 1) for name in STAND_IN_POOLS]
        report_pools = [(name, 1) for name in names] if load_pools else None
        ray.get(directory.add_hot_prefix.remote(push_rows(rows, pool_keys[0])))  # the next push names the other
        directory_process = psutil.Process(ray.get(directory.ping.remote())["pid"])
        results = []
        for n in clients:
            for rate in rates:
                pushes = max(min_pushes, int(round(seconds * rate)))
                for mode_per_node in ([0, per_node] if per_node else [0]):
                    results.append(one_run(directory, directory_process, pollers, n, rate, pushes, rows, pool_keys,
                                           max_concurrency or MAX_CALLS_AT_ONCE, mode_per_node, relay_procs))
                if per_node and report_pools:  # last: the figure it leaves rides on later answers
                    results.append(one_run(directory, directory_process, pollers, n, rate, pushes, rows, pool_keys,
                                           max_concurrency or MAX_CALLS_AT_ONCE, per_node, relay_procs, report_pools))
        return results
    finally:
        ray.kill(directory)
        for actor in pools + pollers:
            ray.kill(actor)


def table(results: list[RunResult]) -> str:
    lines = ["| mode | clients | Hz | directory answers | directory CPU ms / push | answers/s | directory CPU (cores) "
             "| us/answer | busiest thread | relays' CPU | clients' CPU | answer ms p50 / p99 / max | skipped "
             "| B/answer | ping ms max | push call ms max |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.mode} | {r.clients} | {r.rate_hz:g} | {r.directory_answers} "
                     f"| {r.directory_cpu_ms_per_push:.1f} | {r.answers_per_s:.0f} | {r.directory_cpu_share:.3f} "
                     f"| {r.directory_cpu_us_per_answer:.0f} | {r.busiest_thread_share:.3f} | {r.relays_cpu_share:.2f} "
                     f"| {r.clients_cpu_share:.2f} "
                     f"| {r.answer_ms_p50:.1f} / {r.answer_ms_p99:.1f} / {r.answer_ms_max:.1f} | {r.skipped} "
                     f"| {r.answer_bytes} | {r.ping_ms_max:.1f} | {r.push_call_ms_max:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="100,500,1000,2000", help="engines long-polling, per run (comma list)")
    parser.add_argument("--rates", default="0.2,1,2", help="pushes a second (comma list)")
    parser.add_argument("--seconds", type=float, default=10.0, help="push phase per run (at least --min-pushes)")
    parser.add_argument("--min-pushes", type=int, default=3)
    parser.add_argument("--client-procs", type=int, default=4, help="Ray actors the engines are spread over")
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS, help="hot-table rows a push changes (payload)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="the directory's max_concurrency (default: the package's; 1000: Ray's default)")
    parser.add_argument("--engines-per-node", type=int, default=0,
                        help="also run each relayed: this many engines poll their node's relay (0: direct only)")
    parser.add_argument("--relay-procs", type=int, default=2, help="Ray actors the relays are spread over")
    parser.add_argument("--load-figure", action="store_true",
                        help="with --engines-per-node: also relayed with the engines' reports, the load figure pushed")
    parser.add_argument("--pools", type=int, default=100, help="--load-figure: member pools (stand-ins)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    local_ray("ucmp-", num_cpus=2, namespace="pushcost", logging_level="WARNING")
    try:
        results = run_all([int(c) for c in args.clients.split(",")], [float(r) for r in args.rates.split(",")],
                          args.seconds, args.min_pushes, args.client_procs, args.rows, args.max_concurrency,
                          args.engines_per_node, args.relay_procs, args.pools if args.load_figure else 0)
    finally:
        ray.shutdown()
    log.info("results (%d client processes, %d rows a push):\n%s", args.client_procs, args.rows, table(results))
    direct = {(r.clients, r.rate_hz): r for r in results if r.mode == "direct"}
    for r in results:
        base = direct[(r.clients, r.rate_hz)]
        if r.mode == "relayed+load":
            relayed = next(x for x in results
                           if x.mode == "relayed" and (x.clients, x.rate_hz) == (r.clients, r.rate_hz))
            log.info("load_vs_relayed: clients=%d rate_hz=%g directory_cpu_per_push=%.3f relays_cpu_per_push=%.3f "
                     "answer_bytes=%d/%d", r.clients, r.rate_hz,
                     r.directory_cpu_ms_per_push / max(relayed.directory_cpu_ms_per_push, 1e-9),
                     r.relays_cpu_ms_per_push / max(relayed.relays_cpu_ms_per_push, 1e-9),
                     r.answer_bytes, relayed.answer_bytes)
        if r.mode == "relayed":
            log.info("relayed_vs_direct: clients=%d rate_hz=%g directory_answers=%.3f directory_cpu_per_push=%.3f "
                     "answer_ms_p50=%.2f answer_ms_p99=%.2f", r.clients, r.rate_hz,
                     r.directory_answers / max(base.directory_answers, 1),
                     r.directory_cpu_ms_per_push / max(base.directory_cpu_ms_per_push, 1e-9),
                     r.answer_ms_p50 / max(base.answer_ms_p50, 1e-9), r.answer_ms_p99 / max(base.answer_ms_p99, 1e-9))
    largest = max(direct.values(), key=lambda r: (r.clients * r.rate_hz, r.clients))
    log.info("directory_push: clients=%d rate_hz=%g directory_cpu_share=%.3f answer_ms_p99=%.1f",
             largest.clients, largest.rate_hz, largest.directory_cpu_share, largest.answer_ms_p99)


if __name__ == "__main__":
    main()
