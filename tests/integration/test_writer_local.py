"""Writer-local placement on a three-node cluster (``ray.cluster_utils.Cluster``, one shard per
node), through ``StoreClient`` in processes on different nodes: saves stay on the writer's node;
a reader on another node finds them in one call to the family root's owner, then reads the
writer's published index over NIXL (no pin, no call) and the bytes exact, validated against that
index after the copy (an entry removed meanwhile is stale); a prompt that diverges mid-way gets
its stored prefix; the writer's shard dying makes its blocks misses. ``per_block`` spreads the
same saves over every node (what writer-local placement is for). A system prompt many chats
start with becomes a hot prefix: its root's owner stops answering for them, and hands the
chats written before over to their new roots' owners. Readers' copies of a hot prefix are
announced to the directory, whose table names them, pushed as deltas, up to the copy bound;
relayed through a steward (``relay_hot_copies``), the directory takes a few forwards instead of
one call per copying request, and its table names the same pools."""

from __future__ import annotations

import pytest

from tests.support.private_cluster import pinned_nodes, run_driver
from ucm_ray.store.engine.family import ENOUGH_COPIES

BLOCKS, DIVERGE_AT = 48, 30
SYSTEM, TURN, ASKS = 8, 8, 4
RELAYED_COPIES = 6


@pytest.fixture(scope="module")
def results() -> dict:
    """The scenarios' fleets, one after another on one three-node cluster."""
    return run_driver("writer_local_driver.py", ["writer_local:1,writer_local:2,per_block:1,hot,hot_copies,relay"],
                      pinned_nodes(3), 500)[0]


def test_saves_stay_on_the_writers_node_and_other_nodes_find_them_in_one_call(results):
    result = results["writer_local:1"]
    assert result["written"] == BLOCKS
    entries = result["entries_by_node"]
    assert entries.pop(result["writer_node"]) == BLOCKS
    assert set(entries.values()) == {0}  # nothing left the writer's node
    assert sum(result["hints_by_node"].values()) == BLOCKS  # all at the family root's owner
    assert result["same_node"] == {"found": BLOCKS, "got": BLOCKS, "exact": BLOCKS, "calls": 0}
    # another node: one call to the root's owner, then the writer's index read over NIXL
    assert result["other_node"] == {"found": BLOCKS, "got": BLOCKS, "exact": BLOCKS, "calls": 1}
    # the writer's shard counts the other node's reads as it counts its own node's (a touch,
    # posted after the read): they stay recently used there, or evicting pools lose hits
    # (docs/scaling.md, stop 61: ``scale_evict.py --variants notouch``)
    before, same, other = (result[f"writer_reads_{when}"] for when in ("before", "after_same_node", "after_other_node"))
    by_same_node = [same[0] - before[0], same[1] - before[1]]  # [lookups, hits]
    assert by_same_node[0] == by_same_node[1] >= BLOCKS  # every block asked was found
    assert [other[0] - same[0], other[1] - same[1]] == by_same_node
    # an entry read unpinned from another node and removed before its copy is validated: stale
    assert result["removed_mid_copy"] == {"unpinned": 8, "calls": 1, "stale_before": 0, "removed": 8,
                                          "stale_after": 8, "unreadable": 0}
    diverged = result["diverged"]
    assert diverged["found"] == diverged["got"] == diverged["exact"] == DIVERGE_AT
    after = result["after_kill"]
    assert after["found"] == after["got"] == after["exact"] == 0
    assert after["calls"] == 1  # the root's owner answers (or its successor); the dead pool is not read


def test_an_engine_keeps_free_slots_only_where_its_saves_land(results):
    """A baseline of free slots for saves nobody announced: on the writer's own node under
    writer-local placement (a slot on every pool of a 1,000-node fleet, renewed, was a
    reservation per engine and pool), on every node under per-block placement."""
    local = results["writer_local:1"]
    assert local["slot_nodes"] == [local["writer_node"]]
    assert len(results["per_block:1"]["slot_nodes"]) == 3


def test_a_replica_on_another_node_keeps_the_blocks_when_the_writers_shard_dies(results):
    result = results["writer_local:2"]
    entries = dict(result["entries_by_node"])
    assert entries.pop(result["writer_node"]) == BLOCKS  # the primary on the writer's node
    assert sum(entries.values()) == BLOCKS  # one replica of each elsewhere, spread by rendezvous
    assert sorted(result["hints_by_node"].values()) == [0, BLOCKS, BLOCKS]  # 2 root owners, each key with 2 pools
    assert result["other_node"]["exact"] == BLOCKS
    after = result["after_kill"]
    assert after["found"] == after["got"] == after["exact"] == BLOCKS


def test_per_block_placement_spreads_the_same_saves_over_every_node(results):
    result = results["per_block:1"]
    assert result["written"] == BLOCKS
    assert all(count > 0 for count in result["entries_by_node"].values())
    assert sum(result["hints_by_node"].values()) == 0
    assert result["other_node"]["exact"] == BLOCKS


def test_a_system_prompt_many_chats_share_becomes_a_hot_prefix_and_its_root_stops_answering(results):
    result = results["hot"]
    # each chat was found whole on another node, in one call to the system prompt's root owner
    assert result["learning"] == [{"found": SYSTEM + TURN, "calls": 1}] * ASKS
    # that owner learned what the askers shared: the system prompt, and every engine holds it
    assert result["learned"] == SYSTEM
    assert result["table"] == [SYSTEM] * 4  # the directory's table, then each client's
    # the chats written before it became hot: their own blocks handed over to their new roots'
    # owners, so another node's reader asking the new root finds a chat whole, in one call
    assert result["adopted"] == ASKS * TURN
    assert result["old_chat"] == {"found": SYSTEM + TURN, "got": SYSTEM + TURN, "exact": SYSTEM + TURN, "calls": 1}
    # a new chat registers its own blocks under its own root, the block after the system prompt
    assert result["written"] == SYSTEM + TURN
    assert sorted(result["hints_added"].values()) == [0, 0, TURN]
    # and is found whole from another node: the root's owner asked about its own blocks only
    # (TURN keys by each of the read's two lookups, its pin and ``get``'s), the system prompt's
    # blocks taken from the table's pools without asking anyone
    assert result["new_chat"] == {"found": SYSTEM + TURN, "got": SYSTEM + TURN, "exact": SYSTEM + TURN, "calls": 1}
    asked = result["asked"]
    assert sorted(asked.values()) == [0, 0, 2 * TURN]
    assert max(asked, key=asked.get) == max(result["hints_added"], key=result["hints_added"].get)
    # a prompt that is only the hot prefix needs no call at all
    assert result["system_only"] == {"found": SYSTEM, "got": SYSTEM, "exact": SYSTEM, "calls": 0}
    # three nodes, copy_nodes_per_pool 10: one pool per block is the bound, so a reader on
    # another node keeps no copy of the hot prefix (the table names its pool) nor of the chat
    # (the root's owner names its writer's)
    assert result["copy_marks"] == [ENOUGH_COPIES] * (SYSTEM + TURN)


def test_a_readers_copy_of_a_hot_prefix_is_named_by_the_table_pushed_as_a_delta_up_to_the_bound(results):
    result = results["hot_copies"]
    learned = result["learned"]
    assert learned["pools"] == [1] * SYSTEM  # the writer's pool, named when it became hot
    assert result["copied"] == [SYSTEM, SYSTEM]
    # node 0's copy was announced; node 2's client got the changed rows through its long poll,
    # as a delta of the table it held (no forced fetch)
    one_copy = result["one_copy"]
    assert one_copy["pools"] == [2] * SYSTEM
    assert one_copy["revision"] > learned["revision"]
    assert one_copy["deltas"] > learned["deltas"]
    # node 2 reads the hot prefix from the named pools, exact, with no call
    assert result["read"] == {"found": SYSTEM, "got": SYSTEM, "exact": SYSTEM, "calls": 0}
    # node 2's own copy is past the bound (ceil(3 / 2) = 2 pools a block): the table is unchanged
    assert result["after_bound"] == {"revision": one_copy["revision"], "named": 2 * SYSTEM}


def test_relayed_announcements_take_the_directorys_calls_down_and_name_the_same_pools(results):
    result = results["relay"]
    off, on = result["off"], result["on"]
    for phase in (off, on):
        assert phase["written"] == RELAYED_COPIES and phase["copied"] == 2 * RELAYED_COPIES
        assert phase["named"] == [3] * RELAYED_COPIES  # the writer's pool and both readers' copies
    # direct: one directory call per copying request; relayed: the steward's forwards, at most
    # one a second and one at the start (the 12 copies took ~0.08 s here: 2 forwards)
    assert off["directory_calls"] == 2 * RELAYED_COPIES
    assert on["directory_calls"] == result["steward"]["relay_forwards"] <= 2 + int(on["seconds"])
    assert on["directory_calls"] < off["directory_calls"]
    assert result["steward"]["relayed_copies"] == 2 * RELAYED_COPIES and result["steward"]["relay_dropped"] == 0
