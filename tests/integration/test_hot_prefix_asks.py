"""What the hot-prefix learner counts, on a three-node cluster (``ray.cluster_utils.Cluster``, one
shard per node), through ``StoreClient`` in a process on one node (a sticky router's one asker).

``sticky_doc``, ``hot_prefix_asks: 8``: a document whose 8 questions all come to that node
becomes a hot prefix at its root's owner on another node, and the next question's lookup and
hints leave that owner for the owner of the question's own first block. What the simulation's
``asks8`` assumes of the shard's learner (docs/scaling.md, stop 67: at 1,000 nodes sticky such a
document's root owner answers 12x the mean node's calls at the default 64 asks).

``threshold``, the default ``hot_prefix_asks: 64``: one ask is one lookup that asks the root's
owner, as README says and the simulation counts; not a key asked (2 a question, 14 the first),
not a hint registered, not a ``put``'s commit. Stop 67's "8 questions learned at 64, 140 keys"
were 64 questions: its driver then asked ``hot_prefix_asks`` questions (14 + 63 x 2 = 140 keys;
docs/scaling.md, stop 67, helper asks21)."""

from __future__ import annotations

import pytest

from tests.support.private_cluster import pinned_nodes, run_driver

STICKY_DOC, QUESTION, STICKY_ASKS = 12, 2, 8
DEFAULT_ASKS = 64


@pytest.fixture(scope="module")
def results() -> dict:
    return run_driver("writer_local_driver.py", ["sticky_doc,threshold"], pinned_nodes(3), 300)[0]


@pytest.fixture(scope="module")
def result(results) -> dict:
    return results["sticky_doc"]


def test_a_document_one_node_asks_about_becomes_a_hot_prefix_at_8_asks(result):
    assert result["asks"] == result["questions"] == STICKY_ASKS
    assert result["seconds"] < 10  # the questions came within the learner's window
    # one lookup a question reached the document's root owner: the first for the whole prompt,
    # the others for the question's own blocks (the document's are on the asking node)
    assert result["lookups_while_learning"]["document_root"] == STICKY_ASKS
    assert result["asked_while_learning"]["document_root"] == STICKY_DOC + STICKY_ASKS * QUESTION
    # its root's owner learned the document (what the questions share) and every engine holds it
    assert result["learned"] == STICKY_DOC
    assert result["table"] == result["client_table"] == STICKY_DOC


def test_the_next_question_asks_and_registers_at_its_own_roots_owner_not_the_documents(result):
    assert result["written"] == STICKY_DOC + QUESTION
    assert result["hints_added"]["question_root"] == QUESTION
    assert result["hints_added"]["document_root"] == 0
    assert result["asked"]["document_root"] == 0
    assert result["asked"]["question_root"] > 0


def test_the_default_threshold_counts_lookups_not_keys_or_hints(results):
    """Fails if the learner counted keys (138 by the 63rd lookup), hints or both a ``put``'s
    lookup and its registration: the document would be hot before the 64th lookup."""
    got = results["threshold"]
    assert got["asks"] == DEFAULT_ASKS
    assert got["seconds"] < 10  # within one window
    short_keys = STICKY_DOC + (DEFAULT_ASKS - 1) * QUESTION
    assert got["short"] == {"lookups": DEFAULT_ASKS - 1, "keys": short_keys, "learned": 0}
    assert got["at"] == {"lookups": DEFAULT_ASKS, "keys": short_keys + QUESTION, "learned": STICKY_DOC}
    assert got["table"] == STICKY_DOC
