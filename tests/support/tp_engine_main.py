"""One tensor-parallel vLLM engine (CPU) serving a list of prompts, in its own interpreter.

Why a separate interpreter: vLLM's multiprocess executor spawns one worker process per tp rank,
which re-imports the main module (so the engine must be built under ``__main__``) and leaves
its shared-memory queues behind unless the engine is shut down before the process ends.

Usage: python -m tests.tp_engine_main REQUEST_JSON OUT_DIR  (prints one ``RESULT {json}`` line)

The request: ``model``, ``kv`` (a kv-transfer config or null), ``engine`` (extra ``vllm.LLM``
arguments, e.g. ``tensor_parallel_size``), ``prompts`` (token lists, served in order, greedy, 8
tokens with logprobs), ``keys_of`` (indices of prompts whose store keys to report, per rank) and
``kv_of`` (a prompt index and layers whose cached KV to write, per rank, to OUT_DIR/kv.pt).
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
        outputs = []
        for prompt in request["prompts"]:
            out = engine.generate(prompt, 8, logprobs=True)
            outputs.append({"tokens": out["tokens"], "logprobs": out["logprobs"], "cached": out["cached"]})
        result: dict = {"outputs": outputs, "ranks": engine.rank_totals() if request["kv"] else [],
                        "scheduler": engine.scheduler_totals() if request["kv"] else {},
                        "keys": {str(i): [[k.hex() for k in keys]
                                          for keys in engine.rank_block_keys(request["prompts"][i])]
                                 for i in request.get("keys_of", [])}}
        if request.get("kv_of"):
            index, layers = request["kv_of"]
            torch.save(engine.cached_kv(request["prompts"][index], layers), os.path.join(out_dir, "kv.pt"))
    finally:
        engine.close()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
