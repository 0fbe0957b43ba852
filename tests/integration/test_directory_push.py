"""benchmarks/directory_push.py at a tiny size: the real directory's long polls, re-posted by
simulated engines, deliver every pushed version to every engine (the benchmark's figures count
those answers, so a lost or duplicated answer would make them wrong)."""

from __future__ import annotations

from benchmarks.directory_push import run_all


def test_every_engine_gets_every_push(ray_cluster) -> None:
    (result,) = run_all([20], [4.0], seconds=0.5, min_pushes=2, client_procs=1, rows=57)
    assert result.pushes == 2
    assert result.answers == 20 * 2  # one answer per engine per version, none skipped or doubled
    assert result.skipped == 0
    assert result.answer_bytes > 800  # the rows ride on every answer
    assert result.answer_ms_max < 10_000


def test_relayed_engines_get_every_push_and_the_directory_answers_one_poll_per_relay(ray_cluster) -> None:
    direct, relayed = run_all([24], [4.0], seconds=0.5, min_pushes=2, client_procs=1, rows=57, per_node=8,
                              relay_procs=1)
    assert (direct.mode, relayed.mode) == ("direct", "relayed")
    assert relayed.answers == 24 * 2 and relayed.skipped == 0  # every engine, every version, through its relay
    assert relayed.directory_answers == 3 * 2  # three relays, one answer each a push
    assert direct.directory_answers == 24 * 2  # one per engine a push
