"""One tensor-parallel vLLM engine (CPU) serving a list of prompts, in its own interpreter.

Why a separate interpreter: vLLM's multiprocess executor spawns one worker process per tp rank,
which re-imports the main module (so the engine must be built under ``__main__``) and leaves
its shared-memory queues behind unless the engine is shut down before the process ends.

Usage: python -m tests.tp_engine_main REQUEST_JSON OUT_DIR  (prints one ``RESULT {json}`` line)

The request: ``model``, ``kv`` (a kv-transfer config or null), ``engine`` (extra ``vllm.LLM``
arguments, e.g. ``tensor_parallel_size``), ``prompts`` (token lists, served in order, greedy, 8
tokens with logprobs), ``keys_of`` (indices of prompts whose store keys to report, per rank) and
``kv_of`` (a prompt index and layers whose cached KV to write, per rank, to OUT_DIR/kv.pt).
With ``then`` (a list of prompts), the engine then waits for a line on stdin, empties its own
prefix cache (as a fresh engine's) and serves those too: a second ``RESULT`` line, its counters
the changes since the first. One TP=2 start instead of two.
"""

from __future__ import annotations

import json
import logging
import os
import sys


def main() -> None:
    from ucm_ray.testing.tp import TP_ENV

    for name, value in TP_ENV.items():
        os.environ.setdefault(name, value)
    import torch

    from ucm_ray.testing.tp import TpEngine

    request, out_dir = json.loads(open(sys.argv[1]).read()), sys.argv[2]
    engine = TpEngine(request["model"], request["kv"], **request["engine"])
    try:
        result = serve(engine, request["prompts"], bool(request["kv"]))
        result["keys"] = {str(i): [[k.hex() for k in keys] for keys in engine.block_keys(request["prompts"][i])]
                          for i in request.get("keys_of", [])}
        if request.get("kv_of"):
            index, layers = request["kv_of"]
            torch.save(engine.cached_kv(request["prompts"][index], layers), os.path.join(out_dir, "kv.pt"))
        print("RESULT " + json.dumps(result), flush=True)
        # the caller's go-ahead (it changed the store in between); end of input: it gave up
        if request.get("then") is not None and sys.stdin.readline().strip() == "go":
            assert engine.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
            after = serve(engine, request["then"], bool(request["kv"]))
            after["ranks"] = [_minus(now, then) for now, then in zip(after["ranks"], result["ranks"])]
            after["scheduler"] = _minus(after["scheduler"], result["scheduler"])
            print("RESULT " + json.dumps({**after, "keys": {}}), flush=True)
    finally:
        engine.close()


def serve(engine, prompts: list[list[int]], with_connector: bool) -> dict:
    """Greedy outputs of ``prompts`` in order, and the connector's counters since start-up."""
    outputs = []
    for prompt in prompts:
        out = engine.generate(prompt, 8, logprobs=True)
        outputs.append({"tokens": out["tokens"], "logprobs": out["logprobs"], "cached": out["cached"]})
    return {"outputs": outputs, "ranks": engine.rank_totals() if with_connector else [],
            "scheduler": engine.scheduler_totals() if with_connector else {}}


def _minus(now: dict, then: dict) -> dict:
    return {key: value - then.get(key, 0) for key, value in now.items()}


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
