"""A vLLM engine the way users start one: its own interpreter, vLLM's multiprocess engine core
and a separate worker process, joining an existing Ray cluster through ``ray_address``.

Usage: python -m tests.mp_engine_main MODEL_DIR REQUEST_JSON  (prints one JSON line)
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    model, request = sys.argv[1], json.loads(open(sys.argv[2]).read())
    llm = LLM(model=model, enforce_eager=True, block_size=128, dtype="float32", max_model_len=8192,
              max_num_batched_tokens=8192, seed=0, enable_prefix_caching=True,
              distributed_executor_backend="mp", kv_transfer_config=KVTransferConfig(**request["kv"]))
    out = llm.generate([{"prompt_token_ids": request["prompt"]}],
                       SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[0]
    print("RESULT " + json.dumps({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens}),
          flush=True)


if __name__ == "__main__":
    main()
