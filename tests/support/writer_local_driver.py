"""Driver of the writer-local store test, run in a process of its own against a three-node
``PrivateCluster`` (one shard per node): clients on different nodes write and read through
``StoreClient``, one fleet per scenario on the one cluster; prints one JSON line of what each
saw and what each shard holds."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import ray

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # run as a script: ``tests.support`` from this checkout

from tests.support.store_helpers import ClientProcess, key, prompt_keys  # noqa: E402
from ucm_ray.config import UcmRayConfig  # noqa: E402
from ucm_ray.store.hot_copy_relay import steward_key  # noqa: E402
from ucm_ray.store.hot_prefixes import WINDOW_S  # noqa: E402
from ucm_ray.store.placement import owners  # noqa: E402
from ucm_ray.store.shard.fleet import fleet_status, start_fleet_per_node, stop_fleet  # noqa: E402
from ucm_ray.store.types import DIRECTORY_NAME  # noqa: E402

T = TypeVar("T")
BLOCKS = 48
DIVERGE_AT = 30
SYSTEM, TURN, ASKS = 8, 8, 4
"""Hot prefixes: a system prompt's blocks, each chat's own blocks, asks that make a root hot."""
SETTLE_S = 0.5
"""A shard's read counts are settled once they stay put this long (touches are posted every 50 ms)."""


def scenario(placement: str, replication: int) -> dict:
    """One fleet (one shard per node) with these settings: what each client saw, what each
    shard held, then what a reader sees once the writer's shard is dead."""
    config = start_fleet_per_node(UcmRayConfig(ray_namespace=f"wlocal_{placement}_{replication}", pool_bytes=32 << 20,
                                               shard_cpus=0, lookup_timeout_s=30, placement=placement,
                                               replication=replication), 1)
    try:
        clients = [ClientProcess.options(resources={f"node_{i}": 0.01}).remote(config.to_dict()) for i in range(3)]
        written = ray.get(clients[1].write.remote(BLOCKS, 5, "doc"))
        status = fleet_status(config)["shards"]
        node_of = {s["shard_id"]: s["node_id"] for s in status}
        result = {
            "written": sum(written),
            "entries_by_node": {node_of[s["shard_id"]]: s["entries"] for s in status},
            "hints_by_node": {node_of[s["shard_id"]]: s["hints"] for s in status},
            "writer_node": ray.get(clients[1].node.remote()),
        }
        writer_id = next(s["shard_id"] for s in status if s["node_id"] == result["writer_node"])
        counted = _reads_counted(config, writer_id, placement == "writer_local" and replication == 1)
        before = result["writer_reads_before"] = counted(0)
        result["same_node"] = ray.get(clients[1].read.remote(BLOCKS, 5, "doc"))
        same = result["writer_reads_after_same_node"] = counted(before[1] + BLOCKS if before else 0)
        result["other_node"] = ray.get(clients[2].read.remote(BLOCKS, 5, "doc"))
        result["writer_reads_after_other_node"] = counted(same[1] + BLOCKS if same else 0)
        result["diverged"] = ray.get(clients[0].read.remote(BLOCKS, 5, "doc", diverge_at=DIVERGE_AT))
        result["slot_nodes"] = ray.get(clients[1].slot_nodes.remote())
        # another writer's blocks, read unpinned from another node, then removed at their shard
        ray.get(clients[0].write.remote(8, 6, "gone"))
        result["removed_mid_copy"] = ray.get(clients[2].validation_after_removal.remote(8, "gone"))
        # the writer's shard dies: its blocks are misses (or replicas' hits), never wrong bytes
        ray.kill(ray.get_actor(writer_id, namespace=config.ray_namespace))
        result["after_kill"] = ray.get(clients[2].read.remote(BLOCKS, 5, "doc", gone=writer_id))
        return result
    finally:
        stop_fleet(config)


def _reads_counted(config: UcmRayConfig, shard_id: str, wait: bool) -> Callable[[int], list[int] | None]:
    """What ``shard_id`` counted of readers' lookups and hits, once its hits reach the number given
    and stay put for ``SETTLE_S`` (a reader tells a shard what it read in its published index,
    same node or over NIXL, with touches posted after the read: what keeps the read blocks
    recently used there); None unless ``wait`` (other scenarios' reads may be served by a
    replica or another owner)."""

    def read() -> list[int]:
        return next([s["lookups"], s["hits"]] for s in fleet_status(config)["shards"] if s["shard_id"] == shard_id)

    def counted(hits: int) -> list[int] | None:
        if not wait:
            return None
        got = _settled(read, lambda value: value[1] >= hits)
        while True:
            time.sleep(SETTLE_S)
            again = read()
            if again == got:
                return got
            got = again

    return counted


def _hints(config: UcmRayConfig) -> dict[str, tuple[int, int, int]]:
    """Per shard: hints held, keys asked about, lookups its hot-prefix learner was shown."""
    return {s["shard_id"]: (s["hints"], s["hints_asked"], s["hot_asks"]) for s in fleet_status(config)["shards"]}


def _settled(read: Callable[[], T], done: Callable[[T], bool], timeout_s: float = 20.0) -> T:
    """``read()`` once ``done`` holds of it, or the last one after ``timeout_s`` (posted calls
    that nobody awaits, hints and hot-prefix announcements, land a moment later)."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.1)
        value = read()
    return value


def _steady(read: Callable[[], T]) -> T:
    """``read()`` once two reads ``SETTLE_S`` apart agree (posted calls landed)."""
    got = read()
    while True:
        time.sleep(SETTLE_S)
        again = read()
        if again == got:
            return got
        got = again


def hot_prefix_scenario() -> dict:
    """Chats that start with one system prompt, read from nodes other than their writer's: the
    system prompt's root owner, asked ``2 * ASKS`` times (the writer's ``put`` looks each chat up
    first: ``ASKS`` asks, then ``ASKS`` readers), hands what its askers shared to the table;
    then a chat written before is found under its new root (its hints handed over), a new chat
    registers and is found under the block after the system prompt, and the system prompt's
    blocks come from the table's pools without being asked about."""
    config = start_fleet_per_node(UcmRayConfig(ray_namespace="wlocal_hot", pool_bytes=32 << 20, shard_cpus=0,
                                               lookup_timeout_s=30, hot_prefix_asks=2 * ASKS), 1)
    try:
        clients = [ClientProcess.options(resources={f"node_{i}": 0.01}).remote(config.to_dict()) for i in range(3)]
        chats = [prompt_keys([("system", SYSTEM), (f"chat{j}", TURN)]) for j in range(ASKS + 1)]
        for chat in chats[:ASKS]:
            ray.get(clients[1].write_keys.remote(chat, 9))
        learning = [ray.get(clients[j % 2 * 2].ask.remote(chat)) for j, chat in enumerate(chats[:ASKS])]
        directory = ray.get_actor(DIRECTORY_NAME, namespace=config.ray_namespace)
        table = [_settled(lambda: ray.get(directory.ping.remote())["hot_blocks"], lambda blocks: blocks >= SYSTEM)]
        table += ray.get([c.hot_blocks.remote() for c in clients])
        # the chats written before their system prompt became hot moved under their own roots
        adopted = _settled(lambda: sum(s["hints_adopted"] for s in fleet_status(config)["shards"]),
                           lambda count: count >= ASKS * TURN)
        old_chat = ray.get(clients[0].read_keys.remote(chats[1], 9))
        before = _hints(config)
        written = ray.get(clients[1].write_keys.remote(chats[ASKS], 9))
        registered = _settled(lambda: _hints(config),
                              lambda now: sum(now[k][0] - before[k][0] for k in before) >= TURN)
        found = ray.get(clients[2].read_keys.remote(chats[ASKS], 9))
        after = _hints(config)
        system_only = ray.get(clients[0].read_keys.remote(chats[0][:SYSTEM], 9))
        copy_marks = ray.get(clients[0].copy_marks.remote(chats[ASKS]))
        return {"learning": learning, "table": table, "adopted": adopted, "old_chat": old_chat, "written": sum(written),
                "hints_added": {k: registered[k][0] - before[k][0] for k in before},
                "asked": {k: after[k][1] - registered[k][1] for k in before},
                "new_chat": found, "system_only": system_only, "copy_marks": copy_marks,
                "learned": sum(s["hot_blocks_learned"] for s in fleet_status(config)["shards"])}
    finally:
        stop_fleet(config)


def hot_copies_scenario() -> dict:
    """A hot prefix's copies kept by readers on other nodes (``copy_nodes_per_pool: 2``: at most
    ceil(3 / 2) = 2 pools per block): a copy is announced to the directory, whose table then
    names its pool too, pushed to every client as a delta of the table it holds; a copy past
    the bound is kept for its own node and named nowhere."""
    config = start_fleet_per_node(UcmRayConfig(ray_namespace="wlocal_hot_copies", pool_bytes=32 << 20, shard_cpus=0,
                                               lookup_timeout_s=30, hot_prefix_asks=2 * ASKS,
                                               copy_nodes_per_pool=2), 1)
    try:
        clients = [ClientProcess.options(resources={f"node_{i}": 0.01}).remote(config.to_dict()) for i in range(3)]
        chats = [prompt_keys([("system", SYSTEM), (f"chat{j}", TURN)]) for j in range(ASKS)]
        for chat in chats:
            ray.get(clients[1].write_keys.remote(chat, 9))
        for j, chat in enumerate(chats):
            ray.get(clients[j % 2 * 2].ask.remote(chat))
        system = chats[0][:SYSTEM]
        directory = ray.get_actor(DIRECTORY_NAME, namespace=config.ray_namespace)
        learned = ray.get(clients[2].hot_pools.remote(system, 1))
        copied = [ray.get(clients[0].copy_keys.remote(system, 9))]
        one_copy = ray.get(clients[2].hot_pools.remote(system, 2))
        read = ray.get(clients[2].read_keys.remote(system, 9))
        copied.append(ray.get(clients[2].copy_keys.remote(system, 9)))
        time.sleep(1.0)  # the announcement is posted: let it land (it changes nothing)
        status = ray.get(directory.ping.remote())
        return {"learned": learned, "copied": copied, "one_copy": one_copy, "read": read,
                "after_bound": {"revision": status["hot_revision"], "named": status["hot_pools_named"]}}
    finally:
        stop_fleet(config)


RELAYED_COPIES = 6
"""Blocks of the hot prefix each reader copies in the ``relay`` scenario, one request each."""


def _announcements(directory) -> int:
    return ray.get(directory.ping.remote())["served"]["announce_hot_copies"]


def _relay_phase(config: UcmRayConfig, relay: bool, tag: str, directory, writer_pool, steward: int) -> dict:
    """``RELAYED_COPIES`` hot blocks (each stewarded by shard ``steward``), written on node 1,
    copied by readers on nodes 0 and 2 with ``relay_hot_copies`` set to ``relay``."""
    settings = {**config.to_dict(), "relay_hot_copies": relay}
    ids = ray.get(directory.membership.remote()).shard_ids
    candidates = [key(i, tag) for i in range(64 * RELAYED_COPIES)]
    stewards = owners([steward_key([k]) for k in candidates], ids, 1)[:, 0].tolist()
    hot = [k for k, at in zip(candidates, stewards) if at == steward]
    hot = hot[:RELAYED_COPIES]
    clients = [ClientProcess.options(resources={f"node_{i}": 0.01}).remote(settings) for i in range(3)]
    written = sum(ray.get(clients[1].write_keys.remote(hot, 3)))
    ray.get(directory.add_hot_prefix.remote({k: [writer_pool] for k in hot}))
    ray.get([c.hot_pools.remote(hot, 1) for c in clients])
    before = _announcements(directory)
    started = time.monotonic()  # each reader's copies one request at a time, both readers at once
    copied = ray.get([clients[node].copy_keys.remote([k], 3) for k in hot for node in (0, 2)])
    elapsed = time.monotonic() - started
    named = ray.get(clients[1].hot_pools.remote(hot, 3))["pools"]
    time.sleep(1.5)  # anything still on its way lands
    for client in clients:
        ray.kill(client)
    return {"written": written, "copied": sum(copied), "named": named, "seconds": elapsed,
            "directory_calls": _announcements(directory) - before}


def relay_scenario() -> dict:
    """Readers on two nodes keep copies of a hot prefix's blocks written on the third, one
    copying request at a time, first with ``relay_hot_copies`` off (each copy announced to the
    directory), then on (each to the steward, the owner of the block copied's ``steward_key``): the directory's
    ``announce_hot_copies`` calls and the pools its table names in each phase, and the steward's
    relay counters. Its own fleet: ``copy_nodes_per_pool: 1`` (both readers' copies within the
    bound) and a directory whose call counts only this scenario moved."""
    config = start_fleet_per_node(UcmRayConfig(ray_namespace="wlocal_relay", pool_bytes=32 << 20, shard_cpus=0,
                                               lookup_timeout_s=30, copy_nodes_per_pool=1), 1)
    try:
        directory = ray.get_actor(DIRECTORY_NAME, namespace=config.ray_namespace)
        status = fleet_status(config)["shards"]
        probe = ClientProcess.options(resources={"node_1": 0.01}).remote(config.to_dict())
        writer_node = ray.get(probe.node.remote())
        ray.kill(probe)
        writer = next(s for s in status if s["node_id"] == writer_node)["shard_id"]
        shards = ray.get(directory.membership.remote()).shards
        writer_pool = next(s.key for s in shards if s.shard_id == writer)
        steward = next(i for i, s in enumerate(shards) if s.shard_id != writer)
        result = {"off": _relay_phase(config, False, "direct", directory, writer_pool, steward),
                  "on": _relay_phase(config, True, "relayed", directory, writer_pool, steward)}
        stats = {s["shard_id"]: s for s in fleet_status(config)["shards"]}
        result["steward"] = {name: stats[shards[steward].shard_id][name]
                             for name in ("relayed_copies", "relay_forwards", "relay_dropped")}
        return result
    finally:
        stop_fleet(config)


STICKY_DOC, QUESTION, STICKY_ASKS = 12, 2, 8
"""The document one node asks about, each question on it (blocks), and ``hot_prefix_asks`` (the
simulation's ``asks8``, docs/scaling.md stop 67; the package's default is 64) (``sticky_doc``)."""


def sticky_doc_scenario() -> dict:
    """A document whose questions all come to one node (a sticky router), its root's owner on
    another node, ``hot_prefix_asks`` 8: its 8 questions within 10 s (each ``put`` looks its
    prompt up first: one ask of the document's root) make the document a hot prefix although one
    node asked (the askers' rule needs 4); the next question's lookup and hints then go to the
    owner of its own first block, and the document's root owner answers nothing more."""
    config = start_fleet_per_node(UcmRayConfig(ray_namespace="wlocal_sticky", pool_bytes=32 << 20, shard_cpus=0,
                                               lookup_timeout_s=30, hot_prefix_asks=STICKY_ASKS), 1)
    try:
        directory = ray.get_actor(DIRECTORY_NAME, namespace=config.ray_namespace)
        ids = ray.get(directory.membership.remote()).shard_ids
        client = ClientProcess.options(resources={"node_1": 0.01}).remote(config.to_dict())
        writer_node = ray.get(client.node.remote())
        writer = next(s["shard_id"] for s in fleet_status(config)["shards"] if s["node_id"] == writer_node)

        def owner(first: bytes) -> str:
            return ids[int(owners([first], ids, 1)[0, 0])]

        tag = next(f"doc{n}" for n in range(64) if owner(key(0, f"doc{n}")) != writer)
        asks = STICKY_ASKS  # questions asked: as many as the learner needs
        last = next(f"q{j}" for j in range(asks, asks + 64) if owner(key(STICKY_DOC, f"q{j}")) != owner(key(0, tag)))
        questions = [prompt_keys([(tag, STICKY_DOC), (f"q{j}", QUESTION)]) for j in range(asks)]
        questions.append(prompt_keys([(tag, STICKY_DOC), (last, QUESTION)]))
        start = _hints(config)
        started = time.monotonic()
        for question in questions[:asks]:
            ray.get(client.write_keys.remote(question, 9))
        elapsed = time.monotonic() - started
        table = _settled(lambda: ray.get(directory.ping.remote())["hot_blocks"], lambda blocks: blocks >= STICKY_DOC)
        held = ray.get(client.hot_blocks.remote())
        before = _steady(lambda: _hints(config))  # the handover of the questions written before lands
        written = ray.get(client.write_keys.remote(questions[asks], 9))
        after = _settled(lambda: _hints(config),
                         lambda now: sum(now[k][0] - before[k][0] for k in before) >= QUESTION)
        roles = {owner(key(0, tag)): "document_root", owner(questions[asks][STICKY_DOC]): "question_root"}
        learning = {roles.get(k, "other"): before[k][1] - start[k][1] for k in before}
        lookups = {roles.get(k, "other"): before[k][2] - start[k][2] for k in before}
        return {"asks": config.hot_prefix_asks, "questions": asks, "seconds": elapsed,
                "asked_while_learning": learning, "lookups_while_learning": lookups, "table": table,
                "client_table": held, "written": sum(written),
                "learned": sum(s["hot_blocks_learned"] for s in fleet_status(config)["shards"]),
                "hints_added": {roles.get(k, "other"): after[k][0] - before[k][0] for k in before},
                "asked": {roles.get(k, "other"): after[k][1] - before[k][1] for k in before}}
    finally:
        stop_fleet(config)


def threshold_scenario() -> dict:
    """The package's default ``hot_prefix_asks`` (64) taken literally: one node puts questions on
    one document back to back (each ``put`` looks its prompt up first: one lookup that asks the
    document's root owner for the blocks this node's shard lacks, the question's 2 or, the first
    time, all 14), one short of the threshold, then one more. What the root's owner was shown
    (``hot_asks``: lookups; ``hints_asked``: keys) after each step, and what it learned: hot at the
    64th lookup, not at the 63rd, whatever the keys (138 by then) or hints (registered after each
    put) add up to. The learner counts in a window that starts at its first ask 10 s after the
    last window began (``hot_prefixes.WINDOW_S``, from the shard's start): the questions wait for
    one to start with them (a window that ends among them splits the asks: likely why one of stop
    67's back to back runs at 64, its slowest, did not learn)."""
    config = start_fleet_per_node(UcmRayConfig(ray_namespace="wlocal_threshold", pool_bytes=32 << 20, shard_cpus=0,
                                               lookup_timeout_s=30), 1)
    up = time.monotonic()  # the shards' learners started before this
    try:
        ids = ray.get(ray.get_actor(DIRECTORY_NAME, namespace=config.ray_namespace).membership.remote()).shard_ids
        client = ClientProcess.options(resources={"node_1": 0.01}).remote(config.to_dict())
        writer_node = ray.get(client.node.remote())
        writer = next(s["shard_id"] for s in fleet_status(config)["shards"] if s["node_id"] == writer_node)
        tag = next(f"doc{n}" for n in range(64) if ids[int(owners([key(0, f"doc{n}")], ids, 1)[0, 0])] != writer)
        root = ids[int(owners([key(0, tag)], ids, 1)[0, 0])]
        asks = config.hot_prefix_asks

        def shown() -> dict:
            shard = next(s for s in fleet_status(config)["shards"] if s["shard_id"] == root)
            return {"lookups": shard["hot_asks"], "keys": shard["hints_asked"], "learned": shard["hot_blocks_learned"]}

        time.sleep(max(0.0, up + WINDOW_S + 0.5 - time.monotonic()))
        started = time.monotonic()
        for j in range(asks - 1):
            ray.get(client.write_keys.remote(prompt_keys([(tag, STICKY_DOC), (f"q{j}", QUESTION)]), 9))
        short = shown()
        ray.get(client.write_keys.remote(prompt_keys([(tag, STICKY_DOC), (f"q{asks}", QUESTION)]), 9))
        elapsed = time.monotonic() - started
        return {"asks": asks, "seconds": elapsed, "short": short, "at": shown(),
                "table": _settled(lambda: ray.get(client.hot_blocks.remote()), lambda blocks: blocks >= STICKY_DOC)}
    finally:
        stop_fleet(config)


POPULAR_DOC = 6
"""Blocks of the popular document (``popular`` scenario)."""
POPULAR_GAP_S = 12.0
"""Between the first two readers' reads (``popular`` scenario): past stop 65's 10 s popular
window, within the package's ``POPULAR_WINDOW_S`` (50 s)."""


def popular_scenario() -> dict:
    """A document written on node 0 and read once by each of nodes 1-4 in turn (a random
    router in a large fleet), node 2 ``POPULAR_GAP_S`` after node 1: nodes 1 and 2 read it for
    the first time and keep no copy; node 3's first read comes after two other nodes' within the
    window (``POPULAR_READERS``, ``POPULAR_WINDOW_S``: stop 65's 10 s saw node 2's only), so the
    root's owner counts it popular and node 3 keeps a copy; node 4, told so too, loads it from
    node 3's copy, not the writer's pool. ``copy_nodes_per_pool: 1``: the bound (5 pools a
    block) does not stop the copies."""
    config = start_fleet_per_node(UcmRayConfig(ray_namespace="wlocal_popular", pool_bytes=32 << 20, shard_cpus=0,
                                               lookup_timeout_s=30, copy_nodes_per_pool=1), 1)
    try:
        clients = [ClientProcess.options(resources={f"node_{i}": 0.01}).remote(config.to_dict()) for i in range(5)]
        nodes = ray.get([c.node.remote() for c in clients])
        doc = prompt_keys([("popular", POPULAR_DOC)])
        written = ray.get(clients[0].write_keys.remote(doc, 13))
        registered = lambda: sum(s["hints_registered"] for s in fleet_status(config)["shards"])  # noqa: E731
        before = _settled(registered, lambda count: count >= POPULAR_DOC)
        reads = [ray.get(clients[1].read_and_keep.remote(doc, 13))]
        time.sleep(POPULAR_GAP_S)
        reads += [ray.get(clients[i].read_and_keep.remote(doc, 13)) for i in (2, 3)]
        after_copy = _settled(registered, lambda count: count >= before + reads[-1]["kept"])
        shards = fleet_status(config)["shards"]  # node 3's registration confirmed its places
        places = {name: sum(s[name] for s in shards) for name in ("popular_told", "popular_confirmed")}
        reads.append(ray.get(clients[4].read_and_keep.remote(doc, 13)))
        node_name = {node: i for i, node in enumerate(nodes)}
        for read in reads:
            read["sources"] = [node_name.get(source) for source in read["sources"]]
        return {"written": sum(written), "reads": reads, "hints_registered": [before, after_copy], "places": places}
    finally:
        stop_fleet(config)


def main(address: str, scenarios: str) -> None:
    """``scenarios``: comma-separated ``placement:replication`` pairs or named scenarios
    (``hot``, ``hot_copies``, ``relay``, ``popular``, ``sticky_doc``, ``threshold``), run one after another."""
    # the clients' class lives in this checkout's tests/: its workers import it from there too
    ray.init(address=address, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    try:
        results = {}
        named = {"hot": hot_prefix_scenario, "hot_copies": hot_copies_scenario, "relay": relay_scenario,
                 "popular": popular_scenario, "sticky_doc": sticky_doc_scenario,
                 "threshold": threshold_scenario}
        for name in scenarios.split(","):
            if name in named:
                results[name] = named[name]()
                continue
            placement, replication = name.split(":")
            results[name] = scenario(placement, int(replication))
        print(json.dumps(results), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
