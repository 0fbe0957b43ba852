"""``Publishes``: a commit's rows as columns, grouped per grant the way shards take them."""

import numpy as np

from ucm_ray.store.types import NO_CHECKSUM, Location, Publishes, grant_items, rows_picker


def test_joined_batches_group_their_rows_per_pool_and_grant_in_row_order():
    first = Publishes.of([(b"a", Location("s0", 1, 0, 64, 7), 10), (b"b", Location("s1", 2, 64, 64, None), 20),
                          (b"c", Location("s0", 1, 128, 64, None), 10)])
    # another job's rows: its locations list the pools in another order, and a grant of s0 again
    second = Publishes.of([(b"d", Location("s1", 2, 0, 64, 9), 20), (b"e", Location("s0", 1, 192, 64, None), 11),
                           (b"f", Location("s0", 1, 256, 64, None), 10)])
    joined = Publishes.join([first, second])
    grants = {grant: rows.tolist() for grant, rows in joined.grants.items()}
    assert grants == {(("s0", 1), 10): [0, 2, 5], (("s0", 1), 11): [4], (("s1", 2), 20): [1, 3]}
    rows = joined.grants[(("s0", 1), 10)]
    items = grant_items([joined.keys[row] for row in rows.tolist()], joined.locations.offset[rows],
                        joined.locations.checksum[rows])
    assert items == [(b"a", 0, 7), (b"c", 128, None), (b"f", 256, None)]
    assert [joined.locations[row] for row in range(len(joined))] == [
        Location("s0", 1, 0, 64, 7), Location("s1", 2, 64, 64, None), Location("s0", 1, 128, 64, None),
        Location("s1", 2, 0, 64, 9), Location("s0", 1, 192, 64, None), Location("s0", 1, 256, 64, None)]
    assert joined.locations.checksum[1] == NO_CHECKSUM


def test_nothing_to_publish_has_no_grants():
    assert Publishes.of([]).grants == {}
    assert len(Publishes.join([])) == 0
    assert Publishes.join([]).tokens.dtype == np.int64


def test_the_rows_picker_picks_what_a_loop_over_the_rows_does():
    """``rows_picker``'s slice (rows of one run) and ``itemgetter`` against a loop, over random
    ascending row sets: runs, gaps, one row, none."""
    rng = np.random.default_rng(18)
    for _ in range(500):
        column = [bytes([i % 256, i // 256]) for i in range(int(rng.integers(1, 80)))]
        n = len(column)
        kind = rng.integers(4)
        if kind == 0:  # one run
            first = int(rng.integers(n))
            rows = np.arange(first, int(rng.integers(first, n)) + 1)
        elif kind == 1:
            rows = np.asarray([int(rng.integers(n))])
        elif kind == 2:
            rows = np.zeros(0, dtype=np.int64)
        else:  # any ascending subset
            rows = np.flatnonzero(rng.random(n) < rng.random())
        assert rows_picker(rows)(column) == [column[row] for row in rows.tolist()]
