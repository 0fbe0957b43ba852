"""A seeded workload of the shapes users send: hot system prompts, multi-turn chats, long documents.

Token content is not modelled, only what the store sees of it: a prompt is a run of segments (a
system prompt, a document, a chat turn, a question), each a run of blocks whose vLLM-style chained
hash is sha256(parent hash, segment id, block index), made store keys by the real
``ucm_ray.keys.block_keys``. Segment lengths are multiples of 128 tokens (the larger block size), so
the same segments make the same blocks at block 16 and 128 and a block never straddles two segments:
a shared prefix is shared exactly up to its last whole segment, as vLLM's block hashes make it.
"""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass, field

import numpy as np

from ucm_ray.keys import Namespace, block_keys

UNIT_TOKENS = 128
"""Every segment's length is a multiple of this (see the module docstring)."""
BYTES_PER_TOKEN = 128 * 1024
"""An 8B model (32 layers x 8 KV heads x 128 dims x K and V, bf16): 128 KiB of KV per token."""

ROUTERS = ("random", "sticky")


@dataclass(frozen=True)
class WorkloadSpec:
    nodes: int
    block_size: int = 128
    requests: int = 300
    router: str = "random"
    seed: int = 0
    engines_per_node: int = 8
    system_prompts: int = 8
    documents: int = 200
    chat_share: float = 0.5
    doc_share: float = 0.4
    """The rest are one-off prompts (1k-16k tokens, no system prompt)."""
    sys_zipf: float = 1.2
    doc_zipf: float = 1.1
    new_session_p: float = 0.25
    """A chat request opens a new session with this probability, else continues an open one."""
    open_sessions: int = 64
    max_prompt_tokens: int = 131072

    @property
    def engines(self) -> int:
        return self.nodes * self.engines_per_node

    @property
    def block_bytes(self) -> int:
        return self.block_size * BYTES_PER_TOKEN


@dataclass
class Request:
    index: int
    kind: str
    """``chat``, ``doc`` or ``oneoff``."""
    affinity: int
    """What the sticky router hashes: the session (chat) or the document."""
    session: int
    """The user asking: a chat's session, a fresh one per document question or one-off."""
    engine: int
    node: int
    keys: list[bytes]
    tokens: int


@dataclass
class _Chain:
    """A prompt so far: its block hashes (for extending) and store keys."""

    hashes: list[bytes] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return len(self.keys)  # in blocks; see Workload.tokens_of


def _zipf_weights(count: int, exponent: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, count + 1) ** exponent
    return weights / weights.sum()


def _units(rng: np.random.Generator, lo_tokens: int, hi_tokens: int, log: bool = False) -> int:
    """A length in tokens between the bounds, a multiple of ``UNIT_TOKENS``."""
    if log:
        tokens = float(np.exp(rng.uniform(np.log(lo_tokens), np.log(hi_tokens))))
    else:
        tokens = float(rng.uniform(lo_tokens, hi_tokens))
    return max(1, round(tokens / UNIT_TOKENS)) * UNIT_TOKENS


class Workload:
    """Generates the requests of a spec; the same spec always gives the same requests."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        self._rng = np.random.default_rng(spec.seed)
        self._ns = Namespace(label="scale-sim", model="8b", dtype="bfloat16", cache_dtype="bfloat16",
                             block_size=spec.block_size, layout="layer-major").digest()
        self._blocks_per_unit = UNIT_TOKENS // spec.block_size if spec.block_size <= UNIT_TOKENS else 0
        if not self._blocks_per_unit or UNIT_TOKENS % spec.block_size:
            raise ValueError(f"block size must divide {UNIT_TOKENS}, got {spec.block_size}")
        rng = self._rng
        self._sys_tokens = [_units(rng, 1024, 4096) for _ in range(spec.system_prompts)]
        self._doc_tokens = [_units(rng, 8192, 131072, log=True) for _ in range(spec.documents)]
        self._sys_w = _zipf_weights(spec.system_prompts, spec.sys_zipf)
        self._doc_w = _zipf_weights(spec.documents, spec.doc_zipf)
        self._doc_sys = [int(rng.choice(spec.system_prompts, p=self._sys_w)) for _ in range(spec.documents)]
        self._prefix_cache: dict[tuple[int, ...], _Chain] = {}
        self._open: dict[int, _Chain] = {}
        self._next_segment = 10_000_000
        self._next_session = 0

    def requests(self) -> list[Request]:
        return [self._request(index) for index in range(self.spec.requests)]

    # --- requests ---------------------------------------------------------------------------

    def _request(self, index: int) -> Request:
        draw = self._rng.random()
        if draw < self.spec.chat_share:
            kind, affinity, session, chain = "chat", *self._chat_turn()
        elif draw < self.spec.chat_share + self.spec.doc_share:
            kind, affinity, session, chain = "doc", *self._doc_question()
        else:
            kind, affinity, session, chain = "oneoff", *self._oneoff()
        engine = self._route(kind, affinity)
        return Request(index=index, kind=kind, affinity=affinity, session=session, engine=engine,
                       node=engine // self.spec.engines_per_node, keys=list(chain.keys),
                       tokens=len(chain.keys) * self.spec.block_size)

    def _route(self, kind: str, affinity: int) -> int:
        if self.spec.router == "random":
            return int(self._rng.integers(self.spec.engines))
        digest = hashlib.blake2b(f"{kind}:{affinity}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % self.spec.engines

    def _chat_turn(self) -> tuple[int, int, _Chain]:
        """A session's next turn is its last prompt + the answer + a new user turn."""
        rng = self._rng
        if self._open and rng.random() >= self.spec.new_session_p:
            session = int(rng.choice(sorted(self._open)))
            chain = self._open[session]
            chain = self._extend(chain, self._fresh(), _units(rng, 128, 1024))  # the answer
        else:
            session = self._new_session()
            chain = self._system_prefix(int(rng.choice(self.spec.system_prompts, p=self._sys_w)))
        chain = self._extend(chain, self._fresh(), _units(rng, 256, 2048))  # the user's turn
        if len(chain.keys) * self.spec.block_size + 3072 > self.spec.max_prompt_tokens:
            self._open.pop(session, None)  # the next turn would not fit: the session ends here
        else:
            self._open[session] = chain
        if len(self._open) > self.spec.open_sessions:
            del self._open[min(self._open)]  # the oldest session ends
        return session, session, chain

    def _doc_question(self) -> tuple[int, int, _Chain]:
        """System prompt + a Zipf-chosen document + a new question, from a new user."""
        doc = int(self._rng.choice(self.spec.documents, p=self._doc_w))
        key = (self._doc_sys[doc], doc)
        base = self._prefix_cache.get(key)
        if base is None:
            base = self._extend(self._system_prefix(self._doc_sys[doc]), 2_000_000 + doc, self._doc_tokens[doc])
            self._prefix_cache[key] = base
        chain = self._extend(base, self._fresh(), _units(self._rng, 128, 512))
        return doc, self._new_session(), chain

    def _oneoff(self) -> tuple[int, int, _Chain]:
        session = self._new_session()
        return session, session, self._extend(_Chain(), self._fresh(), _units(self._rng, 1024, 16384))

    # --- chains -----------------------------------------------------------------------------

    def _system_prefix(self, system: int) -> _Chain:
        key = (system,)
        chain = self._prefix_cache.get(key)
        if chain is None:
            chain = self._prefix_cache[key] = self._extend(_Chain(), 1_000_000 + system, self._sys_tokens[system])
        return chain

    def _extend(self, chain: _Chain, segment: int, tokens: int) -> _Chain:
        """``chain`` followed by ``tokens`` of segment ``segment`` (a new chain; ``chain`` is kept)."""
        room = self.spec.max_prompt_tokens // self.spec.block_size - len(chain.keys)
        blocks = min(tokens // self.spec.block_size, max(room, 0))
        parent = chain.hashes[-1] if chain.hashes else b"\0" * 32
        segment_id = segment.to_bytes(8, "little")
        new = []
        for block in range(blocks):
            parent = hashlib.sha256(parent + segment_id + block.to_bytes(4, "little")).digest()
            new.append(parent)
        return _Chain(chain.hashes + new, chain.keys + block_keys(self._ns, new, 0))

    def _fresh(self) -> int:
        self._next_segment += 1
        return self._next_segment

    def _new_session(self) -> int:
        self._next_session += 1
        return self._next_session


def add_single_run_args(parser: argparse.ArgumentParser) -> None:
    """One workload's arguments, as the single-run tools (``scale_hot_floor.py``,
    ``scale_split.py``) take them."""
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--block-size", type=int, default=128, choices=[16, 128])
    parser.add_argument("--router", default="random", choices=list(ROUTERS))
    parser.add_argument("--seed", type=int, default=0)


def single_run(args: argparse.Namespace) -> tuple[WorkloadSpec, list[Request], int]:
    """The workload ``add_single_run_args`` described: its spec, its requests, and each node's
    pool in tokens (half the unique tokens over the fleet, at most 262,144)."""
    from benchmarks.scale.runner import pool_tokens_for

    spec = WorkloadSpec(nodes=args.nodes, block_size=args.block_size, requests=args.requests, router=args.router,
                        seed=args.seed)
    requests = Workload(spec).requests()
    unique_tokens = len({key for request in requests for key in request.keys}) * spec.block_size
    return spec, requests, pool_tokens_for(unique_tokens, spec.nodes, 0.5, 262144)
