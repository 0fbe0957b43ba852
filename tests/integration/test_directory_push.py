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
