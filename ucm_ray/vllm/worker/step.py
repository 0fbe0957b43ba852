"""One engine step's state on the worker: its loads, in an explicit phase, and its state saves.

A step that loads nothing and saves no state (most decode steps) never writes into its state:
such steps share one, made once (``StepState()``), so a new one is not paid for at every step.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum

from ucm_ray.store.checksum import Checksum
from ucm_ray.transport.base import PoolKey
from ucm_ray.vllm.layout import GroupLayout
from ucm_ray.vllm.metadata import BlockSaves, LoadJob
from ucm_ray.vllm.worker.copies import PartPosts, Posted
from ucm_ray.vllm.worker.plan import Batch, LoadPlan, Tag

ThreadedLoad = tuple[Future[Posted], set[Tag]]
"""A layer's loads on the copy thread: its batch once posted, and the loads it serves."""


class LoadPhase(Enum):
    NONE = "none"
    """No loads in this step, or they are reported already."""
    PLANNED = "planned"
    """Bound from the step's metadata; ``start_load_kv`` has not posted them yet."""
    BY_LAYER = "by_layer"
    """Some layer's loads wait for that layer's hook (``wait_for_layer_load``)."""
    POSTED = "posted"
    """Every load was posted in ``start_load_kv``, none awaits a layer hook. They are checked
    (landed, validated, reported) once the forward pass is queued, at the first of
    ``wait_for_save``, ``get_finished`` and ``get_block_ids_with_load_errors``: the compute
    stream waits for their bytes on the device while the host launches the forward (checking
    them in ``start_load_kv`` held the forward's launch back for the whole copy)."""


@dataclass
class StepState:
    loads: list[LoadJob] = field(default_factory=list)
    deadline: float = 0.0
    """One deadline bounds every copy of the step (``transfer_timeout_s``)."""
    phase: LoadPhase = LoadPhase.NONE
    state_saves: BlockSaves | None = None
    """This step's mamba states, saved after its forward (``take_state_saves``)."""
    tags: dict[int, list[Tag]] = field(default_factory=dict)
    """Per load job, each of its blocks' tag (row order)."""
    failed: set[Tag] = field(default_factory=set)
    sums: dict[Tag, Checksum] = field(default_factory=dict)
    """Running checksum of each loaded block whose entry has one, taken as each of its layers
    landed (layer order), before the forward pass can write into the block's tail."""
    threaded_layers: dict[str, ThreadedLoad] = field(default_factory=dict)
    """Layer name -> its loads on the copy thread."""
    ordered_layers: dict[str, int] = field(default_factory=dict)
    """Layer name -> its part of ``ordered``, until its hook ran."""
    ordered: PartPosts | None = None
    """The loads on stream-ordered pools, a part per layer, posted a few layers ahead of the
    hooks (``loads.LAYERS_AHEAD``)."""
    unlanded: list[Posted] = field(default_factory=list)
    """Stream-ordered loads the compute stream waits for, not yet checked by the host."""
    load_s: float = 0.0
    """Time spent posting and waiting for this step's loads (``load_seconds``)."""
    hooked: bool = False
    """Some layer's hook ran this step: its forward runs Python between layers (no FULL CUDA
    graph replay), so a layer still awaiting its hook may yet get it (a draft model's layers,
    hooked after vLLM asked for the step's results)."""

    @classmethod
    def bound(cls, loads: list[LoadJob], deadline: float, state_saves: BlockSaves | None) -> StepState:
        return cls(loads=loads, deadline=deadline, state_saves=state_saves,
                   phase=LoadPhase.PLANNED if loads else LoadPhase.NONE)

    # --- loads ---------------------------------------------------------------------------

    def adopt(self, plan: LoadPlan) -> None:
        """The plan's tags, its unloadable blocks as failed, and checksums to take."""
        self.tags = plan.tags
        self.failed |= plan.unsized
        self.sums = {tag: Checksum() for tag in plan.checksummed}

    def loads_started(self) -> None:
        """``start_load_kv`` posted the step's loads (or queued them on the copy thread)."""
        self.phase = LoadPhase.BY_LAYER if self.threaded_layers or self.ordered_layers else LoadPhase.POSTED

    def take_posted(self) -> bool:
        """Whether every load was posted in ``start_load_kv`` and not yet checked (then the
        caller checks them now)."""
        if self.phase is not LoadPhase.POSTED:
            return False
        self.phase = LoadPhase.NONE
        return True

    def take_layer(self, name: str) -> tuple[ThreadedLoad | None, int | None]:
        """A layer's loads, once, as its hook runs: the copy thread's, and its part of ``ordered``."""
        self.hooked = True
        return self.threaded_layers.pop(name, None), self.ordered_layers.pop(name, None)

    @property
    def layers_pending(self) -> bool:
        return bool(self.threaded_layers or self.ordered_layers)

    def unwaited_layers(self) -> set[str]:
        """The layers whose loads still await their hook."""
        return set(self.threaded_layers) | set(self.ordered_layers)

    def take_unwaited(self) -> tuple[list[ThreadedLoad], list[Posted], list[Posted]]:
        """Layer loads whose hook never ran, taken out of the step: the copy thread's, the
        stream-ordered ones posted, and those not posted (now never to be)."""
        threaded, parts = list(self.threaded_layers.values()), sorted(self.ordered_layers.values())
        self.threaded_layers.clear()
        self.ordered_layers.clear()
        posts, self.ordered = self.ordered, None
        if posts is None:
            return threaded, [], []
        first_unposted = posts.next
        return threaded, [posts.posted[part] for part in parts if part < first_unposted], posts.drop()

    def take_unlanded(self) -> list[Posted]:
        """Stream-ordered loads not yet checked by the host, taken out of the step."""
        unlanded, self.unlanded = self.unlanded, []
        return unlanded

    def landed(self, posted: Posted, failed_pools: set[PoolKey], seconds: float,
               layouts: list[GroupLayout]) -> None:
        """A posted load batch is over: its failures, its time, and its blocks' checksums."""
        self.load_s += seconds
        self.failed |= posted.failed_tags | posted.batch.tags_in(failed_pools)
        if self.sums:
            self._update_checksums(posted.batch, failed_pools, layouts)

    def loads_finished(self) -> list[LoadJob]:
        """The loads, reported now: the step has none left."""
        loads, self.loads = self.loads, []
        self.ordered = None
        self.phase = LoadPhase.NONE
        return loads

    def bad_blocks(self, job: LoadJob) -> list[int]:
        """The vLLM block ids of ``job`` whose loads failed."""
        return [tag[1] for tag in self.tags[job.job_id] if tag in self.failed] if self.failed else []

    def _update_checksums(self, batch: Batch, failed_pools: set[PoolKey], layouts: list[GroupLayout]) -> None:
        """Layer order, block by block: only entries that carry a checksum."""
        for group, index in batch.layers:
            for pool, by_group in batch.entries.items():
                if pool in failed_pools or group not in by_group:
                    continue
                for block_id, tag in zip(by_group[group].block_ids.tolist(), by_group[group].tags):
                    running = self.sums.get(tag)
                    if running is not None:
                        for segment in layouts[group].layers[index].segments(block_id):
                            running.update(segment)

    # --- state saves ---------------------------------------------------------------------

    def take_state_saves(self) -> BlockSaves | None:
        """This step's mamba states to save now (once)."""
        saves = self.state_saves
        if saves is not None:
            self.state_saves = None
        return saves
