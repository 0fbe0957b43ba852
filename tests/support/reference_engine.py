"""Greedy tokens of a vLLM engine without the connector (CPU), in a process of its own:
``python -m tests.support.reference_engine MODEL_DIR PROMPT_FILE MAX_TOKENS`` reads the prompt's
token ids (JSON) from PROMPT_FILE and prints the tokens (JSON) as its last line. The Serve tests start it next to
the app, so its start-up overlaps the app's."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ucm_ray.demo import ENGINE_ENV, Engine


def main() -> None:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    model_dir, prompt_file, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompt = json.loads(Path(prompt_file).read_text())
    tokens = Engine(model_dir, None).generate(prompt, max_tokens)["tokens"]
    sys.stdout.write(json.dumps(tokens) + "\n")


if __name__ == "__main__":
    main()
