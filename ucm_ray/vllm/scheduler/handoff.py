"""Prefill/decode through the tier: what a prefill announces, and how long a decode waits for it.

A prefill's one-token response returns before its prompt's saves are committed (they are
planned in the step after its token, and committed once the workers report them). A PD proxy
hands the decode engine the prefill's ``kv_transfer_params`` at once, so a decode that looked
its prompt up then would find nothing and recompute it all. So the prefill (a request whose
params carry ``do_remote_decode``, as Ray Serve LLM's PD proxy and vLLM send them) announces,
under our own key (vLLM's MultiConnector merges several connectors' params), the block-aligned
prompt tokens it saves and its namespace, and a hybrid's LCM boundaries that hold a state (its
chunk ends: a decode whose cap no state meets must not wait for one); the decode's lookup answers
"ask again" until the hit those tokens give is there, or ``pd_wait_s`` passed (then it takes what
is there, counted as a timeout).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, TypeGuard

from ucm_ray.config import UcmRayConfig
from ucm_ray.vllm.scheduler.geometry import CacheGeometry
from ucm_ray.vllm.scheduler.request import Handoff, TrackedRequest
from ucm_ray.vllm.stats import UcmRayStats

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__package__)

PARAMS_KEY = "ucm_ray"
"""Our entry in ``kv_transfer_params``: ``{"tokens": int, "namespace": hex of the rank-0 digest}``,
and for a hybrid ``"states"``: the ascending token positions of its stored states."""


class Handoffs:
    """Builds a prefill's announcement and a decode's wait, and counts both."""

    def __init__(self, geometry: CacheGeometry, config: UcmRayConfig, stats: UcmRayStats) -> None:
        self._geometry = geometry
        self._wait_s = config.pd_wait_s
        self._stats = stats
        self._namespace = geometry.namespaces[0].hex()
        self._warned = False

    # --- the prefill ------------------------------------------------------------------------

    @staticmethod
    def hands_off(request: Request) -> bool:
        """Whether the request is a PD prefill: a decode engine continues it (``do_remote_decode``)."""
        params = request.kv_transfer_params
        return isinstance(params, dict) and bool(params.get("do_remote_decode"))

    def prefill_params(self, tracked: TrackedRequest) -> dict[str, Any] | None:
        """What a finished prefill tells its decode; None for other requests."""
        if not self.hands_off(tracked.request):
            return None
        tokens = self.saved_prompt_tokens(tracked)
        entry: dict[str, Any] = {"tokens": tokens, "namespace": self._namespace}
        if self._geometry.hybrid:
            entry["states"] = sorted({pos for pos in tracked.state_positions if pos <= tokens})
        return {PARAMS_KEY: entry}

    def saved_prompt_tokens(self, tracked: TrackedRequest) -> int:
        """The prompt tokens whose blocks are stored once the request's saves landed: its full
        prompt blocks (those vLLM's own cache held were saved when first computed, or loaded
        from the store); a hybrid's, up to the last LCM boundary whose state it saved."""
        geometry = self._geometry
        prompt = tracked.request.num_prompt_tokens
        tokens = min((prompt // geometry.block_sizes[g] * geometry.block_sizes[g] for g in geometry.attn),
                     default=0)
        tokens = min(tokens, tracked.hashed_tokens())
        return min(tokens, tracked.last_state_pos) if geometry.hybrid else tokens

    # --- the decode -------------------------------------------------------------------------

    def announced(self, request: Request, now: float) -> Handoff | None:
        """A new decode request's wait, where its params hold a prefill's announcement in this
        engine's namespace. One from another namespace (its keys can never match ours) or one we
        cannot read is ignored and counted, the first with a warning."""
        params = request.kv_transfer_params
        entry = params.get(PARAMS_KEY) if isinstance(params, dict) else None
        if entry is None:
            return None
        handoff = self._read(entry, now)
        if handoff is None:
            self._stats.add(handoff_namespace_mismatches=1)
            if not self._warned:
                self._warned = True
                log.warning("ucm-ray: request %s carries a prefill's handoff %r for another namespace than this "
                            "engine's (%s): ignored, its prompt is looked up as any other's (counted in "
                            "handoff_namespace_mismatches; logged once)", request.request_id, entry, self._namespace)
            return None
        self._stats.add(handoffs=1)
        return handoff

    def _read(self, entry: Any, now: float) -> Handoff | None:
        """The wait an announcement in this engine's namespace asks for; None if it is not one."""
        if not isinstance(entry, dict) or entry.get("namespace") != self._namespace:
            return None
        tokens, states = entry.get("tokens"), entry.get("states")
        if not _count(tokens) or not (states is None or isinstance(states, list) and all(map(_count, states))):
            return None
        return Handoff(tokens, started=now, states=None if states is None else tuple(states))

    def expected(self, handoff: Handoff, cap: int) -> int:
        """The store hit (tokens from 0) the announcement gives a lookup capped at ``cap``: a
        hybrid's ends on an LCM boundary that holds a state, the furthest the prefill announced
        (0 if none: then there is nothing to wait for)."""
        tokens = min(handoff.tokens, cap)
        if not self._geometry.hybrid:
            return tokens
        tokens = tokens // self._geometry.lcm * self._geometry.lcm
        if handoff.states is None:
            return tokens
        return max((pos for pos in handoff.states if pos <= tokens), default=0)

    def waits(self, handoff: Handoff, short: bool, now: float) -> bool:
        """After a lookup: whether the request waits on (its hit is short of what the prefill
        announced, and ``pd_wait_s`` has not passed); if not, the wait is over and counted."""
        if short and now - handoff.started < self._wait_s:
            handoff.look_later(now)
            return True
        self.settle(handoff, now, short=short)
        return False

    def settle(self, handoff: Handoff, now: float, *, short: bool) -> None:
        """The wait is over: with the announced hit, or without it (a timeout)."""
        if not handoff.waiting:
            return
        handoff.waiting = False
        self._stats.observe("handoff_wait_seconds", now - handoff.started)
        if short:
            self._stats.add(handoff_timeouts=1)


def _count(value: Any) -> TypeGuard[int]:
    """Whether ``value`` is a token count (an int, not a bool, not negative)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
