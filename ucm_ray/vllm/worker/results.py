"""What the worker reports: per job to the scheduler, and to vLLM what it must redo or may free.

The scheduler commits, frees and releases from the per-job results (``build_worker_meta``);
the worker decides nothing from them.
"""

from __future__ import annotations

from ucm_ray.store.types import Location
from ucm_ray.transport.base import PoolKey
from ucm_ray.vllm.metadata import LoadJob, SaveResult, UcmRayWorkerMetadata

NO_LOAD_ERRORS: set[int] = set()
"""The failed block ids handed to vLLM when no load failed: one empty set, never filled
(``WorkerResults._blocks_failed`` makes a new set). vLLM only reads it: the scheduler tests and
iterates it, the output aggregator of several workers unions it into its own."""


class WorkerResults:
    """Results gathered since they were last taken."""

    def __init__(self, *, one_group: bool) -> None:
        self._one_group = one_group
        """A single-group cache: vLLM maps failed block ids back to their request (for several
        groups it raises, so a failed asynchronous load goes by request id there)."""
        self._meta = UcmRayWorkerMetadata()
        self._load_errors = NO_LOAD_ERRORS
        self._finished_recving: set[str] = set()
        self._finished_sending: set[str] = set()
        self._failed_recving: set[str] = set()
        self.empty = True
        """Nothing gathered since the results were last taken: the takes would hand out nothing.
        Every gathering sets it False, a take that leaves nothing sets it back; the connector's
        result hooks test it (with ``WorkerPart.idle``) before any call (a quiet decode step's
        three result hooks: docs/performance-log.md, stop 67)."""

    # --- gathered ------------------------------------------------------------------------

    def pools_failed(self, pools: set[PoolKey]) -> None:
        self.empty = False
        self._meta.failed_pools |= pools

    def pools_unvalidated(self, pools: set[PoolKey]) -> None:
        self.empty = False
        self._meta.unvalidated_pools |= pools

    def corrupt(self, location: Location) -> None:
        self.empty = False
        self._meta.corrupt.append(location)

    def load_done(self, job: LoadJob, bad: list[int], *, to_vllm: bool) -> None:
        """A load job is over, ``bad`` (vLLM block ids) failed. An async job's request is finished
        receiving, its failed blocks told to vLLM with it (which cuts the waiting request's hit at
        the first: vLLM 0.26 knows no other way), or, for a cache of several groups, it failed
        receiving (its hit is dropped whole). A synchronous job's failed blocks go to vLLM when
        ``to_vllm`` (it may only be told in the step that loaded them)."""
        self.empty = False
        if job.is_async and self._one_group and not job.failed:
            self._blocks_failed(bad)
            self._finished_recving.add(job.req_id)
        elif job.is_async:
            (self._failed_recving if bad or job.failed else self._finished_recving).add(job.req_id)
        elif to_vllm:
            self._blocks_failed(bad)
        self._meta.loads_done.add(job.job_id)
        if bad:
            self._meta.load_failures[job.job_id] = bad

    def _blocks_failed(self, bad: list[int]) -> None:
        """``bad`` joins the failed block ids for vLLM in a new set, never the one held: the empty
        set ``take_load_errors`` handed out last may sit in a step's output that vLLM takes back
        only after the next step ran (asynchronous scheduling's batch queue), and filled in place
        it would carry that step's failures too (review56)."""
        if bad:
            self._load_errors = self._load_errors.union(bad)

    def save_done(self, job_id: int, result: SaveResult) -> None:
        self.empty = False
        self._meta.saves[job_id] = result

    def saved_requests(self, req_ids: set[str]) -> None:
        """The scheduler learned that their saves landed: vLLM may free their blocks now."""
        self.empty = False
        self._finished_sending |= req_ids

    # --- taken ---------------------------------------------------------------------------

    def take_meta(self) -> UcmRayWorkerMetadata | None:
        """The per-job results for the scheduler; None when there are none (most decode steps:
        nothing allocated, nothing for vLLM to carry)."""
        if self._meta.is_empty():
            self._taken()
            return None
        out, self._meta = self._meta, UcmRayWorkerMetadata()
        self._taken()
        return out

    def take_transfers(self) -> tuple[set[str], set[str], set[str]] | None:
        """(finished sending: their saves landed, finished receiving, of which failed); None when
        there are none (most steps: no set is made)."""
        if not (self._finished_sending or self._finished_recving or self._failed_recving):
            self._taken()
            return None
        sending, done, failed = self._finished_sending, self._finished_recving, self._failed_recving
        self._finished_sending, self._finished_recving, self._failed_recving = set(), set(), set()
        self._taken()
        return sending, done | failed, failed

    def take_load_errors(self) -> set[int]:
        """The block ids whose loads failed since the last take; the same empty set when there
        are none (``NO_LOAD_ERRORS``)."""
        if not self._load_errors:
            self._taken()
            return NO_LOAD_ERRORS
        out, self._load_errors = self._load_errors, NO_LOAD_ERRORS
        self._taken()
        return out

    def _taken(self) -> None:
        """After every take: ``empty`` again once the other takes have nothing left either
        (whatever a gathering set, a take puts it right)."""
        self.empty = self._meta.is_empty() and not (self._load_errors or self._finished_sending
                                                    or self._finished_recving or self._failed_recving)
