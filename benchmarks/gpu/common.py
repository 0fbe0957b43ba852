"""What the GPU benchmark's engine parts share: the model profiles and their model directory,
where the engines run (``EngineCores``), starting an engine actor, a request's TTFT and decode
rate, the prompt sets, and the printed figure lines."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
import ray.cloudpickle
import torch

from benchmarks.gpu.engine import ProfiledEngine
from benchmarks.measure import local_ray
from ucm_ray.config import UcmRayConfig

log = logging.getLogger("bench.gpu")
REPO = Path(__file__).resolve().parents[2]

# vLLM's V1 model runner and synchronous scheduling, on every engine (with or without the connector):
# the connector's layer-by-layer loads, which these figures have measured from the start (under
# asynchronous scheduling or the V2 runner it loads hits whole first: ``benchmarks/gpu_async_tier.py``).
GPU_ENGINE_ENV = {"PYTHONHASHSEED": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0",
                  "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


@dataclass(frozen=True)
class TtftProfile:
    model: dict[str, Any]
    sizes: dict[str, int]
    engine: dict[str, Any]
    env: dict[str, str]
    num_gpus: float
    kv_bytes_per_token: int


LLAMA_8B = dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                vocab_size=2048, max_position_embeddings=4096 + 512, dtype="bfloat16")
"""Llama-3.1-8B's layers with a small vocabulary (~7B parameters): a decode step long enough on
an H200 that the device, not the host, bounds it (the 1B's is host-bound); 128 KiB of KV per
token, 64 KiB per layer block of 16 tokens (the issue's block size)."""


def ttft_profile(device: torch.device, quick: bool, shape: str = "1b") -> TtftProfile:
    if shape == "8b":
        if device.type != "cuda":
            raise SystemExit("--shape 8b needs a GPU")
        # vLLM's dummy weights (random, made on the device): writing ~14 GB of random weights
        # took longer than the measurement; a decode's speed does not depend on their values
        engine = dict(dtype="bfloat16", block_size=16, max_model_len=4096 + 512, enforce_eager=False,
                      compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"}, gpu_memory_utilization=0.28,
                      load_format="dummy", async_scheduling=False)
        return TtftProfile(LLAMA_8B, {"4k": 4096 + 8}, engine, GPU_ENGINE_ENV, 0.2, 32 * 2 * 8 * 128 * 2)
    if device.type == "cuda":
        # Llama-3.2-1B's shape (16 layers, hidden 2048, 32 heads, 8 KV heads of 64) with a small
        # vocabulary: ~1.0B parameters, built in well under a minute; 32 KiB of KV per token.
        model = dict(num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8, intermediate_size=8192,
                     vocab_size=2048, max_position_embeddings=32768, dtype="bfloat16")
        sizes = {"4k": 4096 + 8, "16k": 16384 + 8}
        engine = dict(dtype="bfloat16", block_size=16, max_model_len=16384 + 512, enforce_eager=False,
                      compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"}, gpu_memory_utilization=0.2,
                      async_scheduling=False)
        if quick:
            sizes = {"4k": 4096 + 8}
        return TtftProfile(model, sizes, engine, GPU_ENGINE_ENV, 0.2, 16 * 2 * 8 * 64 * 2)
    from ucm_ray.demo import ENGINE_ENV

    model = dict(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512)
    # vLLM on CPU: blocks are multiples of 32 (the Engine's default is 128)
    return TtftProfile(model, {"4k": 512 + 8, "16k": 1024 + 8}, {}, {**ENGINE_ENV, "PYTHONHASHSEED": "0"}, 0,
                       4 * 2 * 2 * 64 * 4)


def bench_model(prof: TtftProfile, model_dir: str | None) -> str:
    """The TTFT and decode model's directory (built once, reused): the profile's random weights,
    or for ``load_format="dummy"`` a config of its shape and a tokenizer only (a small model of
    the same vocabulary is built and its config's shape replaced; no weight file is written)."""
    from ucm_ray.tiny_model import MARKER_NAME, make_tiny_model

    dummy = prof.engine.get("load_format") == "dummy"
    name = "bench-{num_layers}x{hidden_size}".format(**prof.model) + ("-dummy" if dummy else "")
    out = Path(model_dir or REPO / ".models" / name)
    if not dummy:
        return str(make_tiny_model(out, **prof.model))
    if (out / "config.json").is_file():
        return str(out)
    small = make_tiny_model(out.with_name(out.name + "-tokenizer"), vocab_size=prof.model["vocab_size"],
                            max_position_embeddings=prof.model["max_position_embeddings"], dtype=prof.model["dtype"])
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(small, staging, ignore=shutil.ignore_patterns("*.safetensors*", MARKER_NAME))
    config = json.loads((staging / "config.json").read_text())
    shape = prof.model
    config.update(num_hidden_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
                  num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
                  intermediate_size=shape["intermediate_size"], head_dim=shape["hidden_size"] // shape["num_heads"])
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    staging.rename(out)
    return str(out)


@dataclass(frozen=True)
class EngineCores:
    """Where the engines compared run: the one measured on ``turn``, the others parked on
    ``parked`` (None: the host has too few cores to pin; every engine runs anywhere). Engines
    pinned each to cores of their own differed from run to run by which cores they had (the
    performance log has the figures), so every engine is measured on the same ones, one engine
    at a time."""

    turn: list[int] | None
    parked: list[int] | None


def engine_cores(device: torch.device, per_engine: int = 4) -> EngineCores:
    """``per_engine`` cores to measure on, those nearest the GPU first (its NUMA node's, from
    sysfs), the first two left to the driver and the shards, and as many for the engines not
    measured meanwhile (idle: they share theirs)."""
    usable = sorted(os.sched_getaffinity(0))
    near: list[int] = []
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        bus = f"{getattr(props, 'pci_domain_id', 0):04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        try:
            with open(f"/sys/bus/pci/devices/{bus}/local_cpulist") as f:
                near = [c for c in parse_cpulist(f.read()) if c in usable]
        except (OSError, ValueError, AttributeError):
            near = []
    ordered = near + [c for c in usable if c not in near]
    log.info("cores near the GPU: %s of %s", near or "unknown", usable)
    per_engine = min(per_engine, (len(usable) - 2) // 2)
    if per_engine < 2:
        return EngineCores(None, None)
    return EngineCores(ordered[2:2 + per_engine], ordered[2 + per_engine:2 + 2 * per_engine])


def parse_cpulist(text: str) -> list[int]:
    """``0-3,8,10-11`` -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            out.extend(range(int(first), int(last or first) + 1))
    return out


@contextmanager
def turn_cores(engine: Any, cores: EngineCores) -> Iterator[None]:
    """``engine`` on the cores every engine is measured on, parked again after."""
    if cores.turn:
        ray.get(engine.pin.remote(cores.turn))
    try:
        yield
    finally:
        if cores.parked:
            ray.get(engine.pin.remote(cores.parked))


def on_turn(cores: EngineCores, measure: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``measure(engine, item)`` (for ``in_turn``) with the engine on the turn cores."""
    def pinned(engine: Any, item: Any) -> Any:
        with turn_cores(engine, cores):
            return measure(engine, item)
    return pinned


def engine_actor(prof: TtftProfile, engine_class: type = ProfiledEngine) -> Any:
    """``engine_class`` as a Ray actor with the profile's GPU share and environment. This
    package travels to the workers by value, as a script's own code does: they need not have
    the checkout on their path."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__package__])
    return ray.remote(num_cpus=0, num_gpus=prof.num_gpus, runtime_env={"env_vars": prof.env})(engine_class)


def connector_config(cfg: UcmRayConfig) -> dict[str, Any]:
    """The engines' ``kv_transfer_config`` with the connector on ``cfg``'s fleet, loads layer by layer."""
    from ucm_ray.demo import kv_transfer_config

    return kv_transfer_config({"ray_namespace": cfg.ray_namespace, "lookup_timeout_s": 60, "layerwise": True})


def start_engine(remote: Any, model: str, prof: TtftProfile, label: str, kv_config: dict[str, Any] | None,
                 cpus: list[int] | None, warmup: list[list[int]]) -> Any:
    """An engine actor, up once it served each ``warmup`` prompt (an engine's first prompt of a
    size ran slower than the next)."""
    started = time.perf_counter()
    engine = remote.remote(model, kv_config, cpus=cpus, **prof.engine)
    for prompt_ids in warmup:
        ray.get(engine.generate.remote(prompt_ids, 1))
    log.info("engine %s up in %.1f s on cores %s", label, time.perf_counter() - started,
             ray.get(engine.affinity.remote()))
    return engine


def ttft_of(result: dict[str, Any]) -> float:
    return result["ttft"] if result.get("ttft") else result["seconds"]


def decode_rate(result: dict[str, Any]) -> float:
    """Tokens per second after the first one: ``(tokens - 1) / (seconds - TTFT)``."""
    return (len(result["tokens"]) - 1) / (result["seconds"] - ttft_of(result))


def decode_prompts(model: str, prof: TtftProfile, per_size: int, batch: int, rounds: int, warmup_per_size: int = 1
                   ) -> tuple[dict[str, list[list[int]]], dict[str, list[list[list[int]]]], list[list[int]]]:
    """(``per_size`` fresh prompts per size, in no cache nor the store; ``rounds`` batches of
    ``batch`` prompts per size; an engine's warm-up prompts: a short one and ``warmup_per_size``
    of each size, since an engine's first prompts of a size ran slower than the next)."""
    from ucm_ray.tiny_model import synthetic_prompt

    sizes = list(prof.sizes.items())
    fresh = {size: [synthetic_prompt(model, n, seed=100 * (j + 1) + 50 + i) for i in range(per_size)]
             for j, (size, n) in enumerate(sizes)}
    batched = {size: [[synthetic_prompt(model, n, seed=20000 + 1000 * j + 100 * r + i) for i in range(batch)]
                      for r in range(rounds)]
               for j, (size, n) in enumerate(sizes)} if batch else {}
    warmup = [synthetic_prompt(model, 64, seed=9999)] + [synthetic_prompt(model, n, seed=9000 + j + 100 * k)
                                                          for j, (_, n) in enumerate(sizes)
                                                          for k in range(warmup_per_size)]
    return fresh, batched, warmup


def print_figures(device: torch.device, quick: bool, results: dict[str, Any]) -> None:
    """The run's figures, one ``name=value`` line each (what the README, the performance log and
    a CI log grep for), after a line naming the device."""
    print(f"device={torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} "
          f"quick={quick}")
    for name, value in results.items():
        print(f"{name}={value:.3f}" if isinstance(value, float) else f"{name}={value}")


def probe_start(namespace: str) -> tuple[torch.device, TtftProfile, str]:
    """A one-GPU probe's start (``benchmarks/gpu_*.py``): logging, the GPU, a private Ray in
    ``namespace``, the ~1B profile at 4k and its model's directory."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    local_ray("ucmg-", num_cpus=8, num_gpus=1, logging_level="WARNING", log_to_driver=False, namespace=namespace)
    prof = replace(ttft_profile(device, False), sizes={"4k": 4096 + 8})
    return device, prof, bench_model(prof, None)
