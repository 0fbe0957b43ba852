"""PD benchmark: prefill/decode handed off through the tier, against the same two engines serving
whole requests, and against vLLM's NixlConnector (the connector Ray Serve LLM's PD app defaults to).

Three systems, each request a fresh prompt (in no cache nor store) of ``--tokens`` tokens and
``--decode-tokens`` greedy new tokens (EOS ignored):
- ``single``: two engines with the connector, each serving whole requests (in turn);
- ``pd-ucm``: the same two engines as a PD proxy drives them: the prefill engine gets the request
  with ``do_remote_decode`` and one token, the decode engine the params its output carries. The
  prefill's saves run once the decode was sent (a serving engine runs that step at once), so the
  decode's lookup may wait for them (``pd_wait_s``);
- ``pd-nixl``: the same handoff between two engines with vLLM's NixlConnector (CPU buffers, UCX):
  the decode pulls the prefill's blocks point to point.
TTFT of a PD request = the prefill's own TTFT + the decode's (vLLM's ``first_token_latency`` of
each: what a client behind a proxy waits, less the proxy's own hops; the decode's share, its wait
for the prefill's saves or pull plus its load and first token, in its own column; vLLM counts no
cached tokens for NixlConnector's pulled blocks, so its column says 0); time per output token (TPOT)
= the decode's (seconds - TTFT) / (tokens - 1). Medians over the prompts; the systems take each
prompt in turn, the order rotating, so the box's drift falls on all alike; one warm-up request
per system first (not counted). Nothing here asserts a timing.

Last lines: ``pd_ttft_vs_single=`` pd-ucm / single, ``pd_tpot_vs_single=`` the same for TPOT,
``pd_ttft_vs_nixl=`` and ``pd_tpot_vs_nixl=`` pd-ucm / pd-nixl, ``nixl_ttft_vs_single=``, then
``pd_hit_fraction=`` the decode's cached tokens over its prompt's, ``pd_handoff_wait_ms_avg=`` (the
decode's wait for the prefill's saves, of its TTFT share) and ``pd_handoff_timeouts=``.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

import ray

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: benchmarks.*
from benchmarks.measure import in_turn, local_ray  # noqa: E402
from ucm_ray.config import UcmRayConfig  # noqa: E402
from ucm_ray.demo import ENGINE_ENV, kv_transfer_config  # noqa: E402
from ucm_ray.store.shard.fleet import running_fleet  # noqa: E402
from ucm_ray.testing.engines import ProbedEngine  # noqa: E402
from ucm_ray.tiny_model import make_tiny_model, synthetic_prompt  # noqa: E402

log = logging.getLogger("bench.pd")

PD_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
NIXL_PORTS = (5601, 5611)
"""The NIXL engines' side-channel ports (one host: each engine its own)."""


@dataclass
class System:
    """A system's two engines, and what each of its requests measured."""

    name: str
    engines: tuple[Any, Any]
    pd: bool
    ttft: list[float] = field(default_factory=list)
    decode_ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    cached: list[float] = field(default_factory=list)


def engine(model: str, kv: dict[str, Any] | None, env: dict[str, str] | None = None) -> Any:
    return ray.remote(num_cpus=0, runtime_env={"env_vars": {**ENGINE_ENV, **(env or {})}})(ProbedEngine).remote(
        model, kv)


def serve(system: System, prompt: list[int], new_tokens: int, turn: int) -> dict[str, float]:
    """One request: whole on one engine (in turn), or prefill then decode."""
    if not system.pd:
        out = ray.get(system.engines[turn % 2].generate_pd.remote(prompt, new_tokens, {}, ignore_eos=True))
        return {"ttft": out["ttft"], "decode": out, "cached": 0.0}
    prefill, decode = system.engines
    first = ray.get(prefill.generate_pd.remote(prompt, 1, PD_PREFILL, flush=False))
    pending = decode.generate_pd.remote(prompt, new_tokens, first["kv_transfer_params"], ignore_eos=True)
    ray.get(prefill.flush.remote())  # the prefill's saves (NixlConnector: nothing to do)
    out = ray.get(pending)
    return {"ttft": first["ttft"] + out["ttft"], "decode": out, "cached": out["cached"] / len(prompt)}


def record(system: System, got: dict[str, Any]) -> None:
    out = got["decode"]
    system.ttft.append(got["ttft"])
    system.decode_ttft.append(out["ttft"])
    system.tpot.append((out["seconds"] - out["ttft"]) / (len(out["tokens"]) - 1))
    system.cached.append(got["cached"])


def measure(systems: list[System], model: str, tokens: int, prompts: int, new_tokens: int) -> None:
    """A warm-up request per system, then ``prompts`` prompts in turn; each system's prompts its own
    (seeded apart): one system's saves never warm another's."""
    seeds = {system.name: 1000 * (i + 1) for i, system in enumerate(systems)}
    for system in systems:
        serve(system, synthetic_prompt(model, tokens, seed=seeds[system.name] + 999), new_tokens, 0)
    by_name = {system.name: system for system in systems}

    def one(system: System, index: int) -> None:
        prompt = synthetic_prompt(model, tokens, seed=seeds[system.name] + index)
        record(system, serve(system, prompt, new_tokens, index))

    in_turn(by_name, list(range(prompts)), one)


def print_report(systems: dict[str, System], decode_totals: dict[str, Any]) -> None:
    """The table, then the ratios as the last lines (what a CI log or a script greps for)."""
    print(f"\n{'system':>8} {'TTFT p50 ms':>12} {'of it the decode':>17} {'TPOT p50 ms':>12} {'decode cached':>14}")
    med = {name: (statistics.median(s.ttft), statistics.median(s.tpot)) for name, s in systems.items()}
    for name, s in systems.items():
        print(f"{name:>8} {med[name][0] * 1e3:>12.1f} {statistics.median(s.decode_ttft) * 1e3:>17.1f} "
              f"{med[name][1] * 1e3:>12.2f} {statistics.median(s.cached):>14.3f}")
    print(f"pd_ttft_vs_single={med['pd-ucm'][0] / med['single'][0]:.3f}")
    print(f"pd_tpot_vs_single={med['pd-ucm'][1] / med['single'][1]:.3f}")
    print(f"pd_ttft_vs_nixl={med['pd-ucm'][0] / med['pd-nixl'][0]:.3f}")
    print(f"pd_tpot_vs_nixl={med['pd-ucm'][1] / med['pd-nixl'][1]:.3f}")
    print(f"nixl_ttft_vs_single={med['pd-nixl'][0] / med['single'][0]:.3f}")
    print(f"pd_hit_fraction={statistics.median(systems['pd-ucm'].cached):.3f}")
    waits = decode_totals.get("handoff_wait_seconds_count", 0)
    print(f"pd_handoff_wait_ms_avg={1e3 * decode_totals.get('handoff_wait_seconds', 0) / max(waits, 1):.1f}")
    print(f"pd_handoff_timeouts={decode_totals.get('handoff_timeouts', 0)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=64)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for k, v in {**ENGINE_ENV, "RAY_USAGE_STATS_ENABLED": "0"}.items():
        os.environ.setdefault(k, v)
    model = str(make_tiny_model(os.path.join(".models", "tiny")))
    local_ray("ucmpd-", num_cpus=4, logging_level="WARNING", log_to_driver=False)
    cfg = UcmRayConfig(num_shards=2, pool_bytes=512 << 20, ray_namespace="ucm_ray_pd_bench")
    try:
        with running_fleet(cfg):
            kv = kv_transfer_config({"ray_namespace": cfg.ray_namespace, "pd_wait_s": 10.0})
            log.info("loading two engines with the connector and two with NixlConnector")
            ucm = (engine(model, kv), engine(model, kv))
            nixl = tuple(engine(model, NIXL, {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
                                              "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}) for port in NIXL_PORTS)
            systems = [System("single", ucm, pd=False), System("pd-ucm", ucm, pd=True),
                       System("pd-nixl", (nixl[0], nixl[1]), pd=True)]
            measure(systems, model, args.tokens, args.prompts, args.decode_tokens)
            decode_totals = ray.get(ucm[1].connector_totals.remote())["scheduler"]
    finally:
        ray.shutdown()
    print_report({system.name: system for system in systems}, decode_totals)


if __name__ == "__main__":
    main()
