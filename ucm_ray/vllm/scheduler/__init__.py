"""The scheduler half of the connector: owner of the block lifecycle.

Every control call of the tier is made here, through a ``BlockStore``, and never waited on: a
lookup is posted once per request (one call per shard per tp rank) and
``get_num_new_matched_tokens`` answers ``None`` ("ask again") until it lands. Lookups *pin*
what they find, so nothing vLLM was promised can be evicted before the worker copies it. Saves
are planned into slots granted ahead of time (``SlotSupply``): a prompt's blocks are copied
from the start of the step after its first token, beside that step's forward pass, so no save
(neither its copies nor its host work) delays a cold request's first token; generated blocks
are saved DECODE_SAVE_TOKENS at a time, the rest when the request ends; a finished request's
blocks are kept (vLLM's delayed free) until the step that saved them reported it. The worker
reports per-job results through vLLM's worker-to-scheduler metadata; from them this side
commits the entries that landed, frees the slots that did not, releases pins and removes
entries that failed their checksum. The worker makes no control call at all.

A prefill whose decode runs on another engine (``do_remote_decode``) announces in its
``kv_transfer_params`` the prompt tokens it saves; the decode's lookup waits for them, at most
``pd_wait_s`` (``handoff``).

Modules, each importing only those listed before it: ``geometry`` (the cache's groups and keys, the
start-up checks), ``request`` (a request's explicit phase), ``handoff`` (what a PD prefill
announces, how long its decode waits), ``timing``, ``answers`` (control calls in flight),
``save_jobs``, ``saves``, ``lookup``, ``loads``, ``results``, and ``part`` (the façade vLLM's
hooks call).
"""

from ucm_ray.vllm.scheduler.geometry import NULL_BLOCK_ID, engine_namespaces
from ucm_ray.vllm.scheduler.lookup import LOOKUP_GRACE_S
from ucm_ray.vllm.scheduler.part import SchedulerPart
from ucm_ray.vllm.scheduler.request import HOLD_S, Phase
from ucm_ray.vllm.scheduler.saves import DECODE_SAVE_TOKENS, PROMPT_SLOT_WAIT_S

__all__ = ["DECODE_SAVE_TOKENS", "HOLD_S", "LOOKUP_GRACE_S", "NULL_BLOCK_ID", "PROMPT_SLOT_WAIT_S",
           "Phase", "SchedulerPart", "engine_namespaces"]
