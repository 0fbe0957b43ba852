"""The benchmarks' hook timer: every call timed, the originals back afterwards, whatever happened."""

from __future__ import annotations

import pytest

from ucm_ray.testing.timing import timed_calls


class Hooks:
    def __init__(self) -> None:
        self.calls = 0

    def hook(self, value: int) -> int:
        self.calls += 1
        return value * 2

    def failing(self) -> None:
        raise RuntimeError("boom")


def test_instance_and_class_methods_are_timed_per_call_and_restored() -> None:
    hooks, other = Hooks(), Hooks()
    with timed_calls([(hooks, ("hook", "absent"), "obj"), (Hooks, ("failing",), "cls"), (None, ("hook",), "none")]) \
            as spent:
        assert hooks.hook(3) == 6 and hooks.hook(4) == 8
        other.hook(1)  # another instance: not timed
        with pytest.raises(RuntimeError, match="boom"):
            other.failing()  # patched on the class: every instance, timed even when it raises
    assert sorted(spent) == ["cls.failing", "obj.hook"]
    assert len(spent["obj.hook"]) == 2 and len(spent["cls.failing"]) == 1
    assert all(seconds >= 0 for seconds in spent["obj.hook"])
    assert "hook" not in vars(hooks)  # the instance's wrapper is gone: the class's method again
    assert Hooks.failing.__qualname__ == "Hooks.failing"
    assert hooks.calls == 2 and other.calls == 1


def test_originals_come_back_when_the_timed_work_raises() -> None:
    hooks = Hooks()
    with pytest.raises(ValueError), timed_calls([(hooks, ("hook",), "obj")]):
        raise ValueError("the benchmark failed")
    assert "hook" not in vars(hooks)


def test_the_gpu_benchmarks_inner_parts_time_every_way_a_step_posts_its_copies() -> None:
    """``in.shm_copies`` (``benchmarks/gpu/engine.py``'s ``inner_parts``) times each of
    ``_CudaCopies``'s posts: a save and a load at once go through ``post_whole`` since stop 59,
    and an untimed post leaves the nested breakdown without them (``timed_calls`` skips a name
    silently, so nothing else would say so)."""
    from types import SimpleNamespace

    from benchmarks.gpu.engine import inner_parts
    from ucm_ray.transport import shm

    saves = SimpleNamespace(jobs=object())
    scheduler = SimpleNamespace(scheduler_part=SimpleNamespace(lookups=object(), saves=saves, results=object(),
                                                               slots=object()))
    (timed,) = [names for target, names, _ in inner_parts(scheduler, None) if target is shm._CudaCopies]
    posts = {name for name in vars(shm._CudaCopies) if name.startswith("post")}
    assert posts == {"post", "post_each", "post_whole"} and posts <= set(timed), timed
