"""The worker half of the connector: moves bytes, reports what happened, decides nothing.

Every location comes decided in the step's metadata (pins and slots are the scheduler's), and
no control call (no Ray call) is made here. Each step's loads land before the layers that read
them (``loads``), saves are taken late and outlive their step (``saves``), and results go back
per job through ``build_worker_meta`` (``results``); the scheduler commits, frees and releases
from them. One deadline (``transfer_timeout_s``) bounds a step's copies: a hung pool delays a
forward pass by that much at most, and whatever has not landed by then is a failed load (vLLM
recomputes) or a save that never becomes visible.

``part`` (``WorkerPart``: vLLM's hooks, in order) runs ``step`` (one step's state), ``plan``
(metadata to copy jobs, as arrays), ``copies`` (posting and waiting, per kind of pool),
``loads``, ``saves`` and ``results``.
"""

from ucm_ray.vllm.worker.part import WorkerPart
from ucm_ray.vllm.worker.step import LoadPhase, StepState

__all__ = ["LoadPhase", "StepState", "WorkerPart"]
