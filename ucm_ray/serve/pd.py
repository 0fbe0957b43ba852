"""The prefill/decode Serve app: Ray Serve LLM's PD app whose two engines hand off through the tier.

``serve run`` calls ``build_pd_app`` with Ray's ``PDServingArgs`` keys (``prefill_config``,
``decode_config``, ``ingress_cls_config``, ``ingress_deployment_config``) plus the same ``tier:``
section ``build_app`` takes. Both engines get the connector as ``kv_both``: Ray's PD proxy sends
the prefill ``do_remote_decode`` and hands its response's ``kv_transfer_params`` to the decode,
which is all the handoff needs (``ucm_ray.vllm.scheduler.handoff``). Ray does not know our
connector's name and falls back to its default request shaping, which is the one we want.

The two engines must store under one namespace, or the decode never finds what the prefill
saved and recomputes every prompt, silently. That is refused here, before anything starts,
naming the setting that differs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ucm_ray.config import ConfigError, UcmRayConfig
from ucm_ray.serve.app import Tier, ensure_fleet, llm_config_dict, validate, with_connector

log = logging.getLogger(__name__)

ROLES = ("prefill_config", "decode_config")


def _draft(engine_kwargs: Mapping[str, Any], model: str) -> str:
    """The draft model that joins the stored blocks' shape ("" for none, n-gram, or the target
    itself, as ``geometry._draft_model`` reads it from vLLM's config)."""
    spec = engine_kwargs.get("speculative_config") or {}
    draft = spec.get("model") if isinstance(spec, Mapping) else None
    return "" if not draft or draft == model else str(draft)


def namespace_fields(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of one engine config that go into its store namespace (``geometry.engine_namespaces``),
    unset ones as vLLM's defaults so that an unset value and its default compare equal."""
    loading = entry.get("model_loading_config") or {}
    kwargs = entry.get("engine_kwargs") or {}
    extra = (kwargs.get("kv_transfer_config") or {}).get("kv_connector_extra_config") or {}
    model = str(extra.get("model_id") or loading.get("model_source") or loading.get("model_id") or "")
    return {
        "tier namespace": extra.get("namespace", UcmRayConfig.namespace),
        "model": model,
        "revision": kwargs.get("revision"),
        "dtype": kwargs.get("dtype", "auto"),
        "kv_cache_dtype": kwargs.get("kv_cache_dtype", "auto"),
        "block_size": kwargs.get("block_size"),
        "tensor_parallel_size": kwargs.get("tensor_parallel_size", 1),
        "pipeline_parallel_size": kwargs.get("pipeline_parallel_size", 1),
        "draft model": _draft(kwargs, model),
    }


def check_same_namespace(prefill: Mapping[str, Any], decode: Mapping[str, Any]) -> None:
    """One ``ConfigError`` line naming the first setting that gives the two engines different
    store namespaces: the decode would never find the prefill's blocks."""
    ours, theirs = namespace_fields(prefill), namespace_fields(decode)
    for field, value in ours.items():
        if theirs[field] != value:
            raise ConfigError(f"prefill_config and decode_config would store under different namespaces, so the "
                              f"decode never finds the prefill's blocks: {field} is {value!r} for the prefill, "
                              f"{theirs[field]!r} for the decode")


def pd_serving_args(args: Mapping[str, Any], config: UcmRayConfig) -> dict[str, Any]:
    """``build_pd_openai_app``'s arguments: the connector added to both engines, checked by Ray's schema."""
    # Ray 2.60 exports the builder, not its schema: the schema from where the builder reads it
    from ray.llm._internal.serve.serving_patterns.prefill_decode.builder import PDServingArgs

    serving = {k: v for k, v in args.items() if k != "tier"}
    for role in ROLES:
        if serving.get(role) is None:
            raise ConfigError(f"{role}: missing; a PD app needs a prefill_config and a decode_config")
        serving[role] = with_connector(llm_config_dict(serving[role], role), config, role)
    check_same_namespace(serving["prefill_config"], serving["decode_config"])
    validate(PDServingArgs, serving, "PD app")
    return serving


def prepare_pd_app(args: Mapping[str, Any]) -> tuple[dict[str, Any], Tier]:
    """Validate ``args``; return ``build_pd_openai_app``'s arguments and the tier. Starts nothing."""
    if not isinstance(args, Mapping):
        raise ConfigError(f"app args: expected a mapping with prefill_config, decode_config and tier, got {args!r}")
    tier = Tier.from_dict(args.get("tier"))
    return pd_serving_args(args, tier.config), tier


def build_pd_app(args: dict[str, Any]) -> Any:
    """Serve ``import_path`` target: validate, start the fleet, build Ray's PD app."""
    from ray.serve.llm import build_pd_openai_app

    serving, tier = prepare_pd_app(args)  # everything checked before anything starts
    config = ensure_fleet(tier)
    if config != tier.config:  # engines get the fleet's real size
        serving = pd_serving_args(args, config)
    log.info("ucm-ray: prefill and decode of %r hand off through a %d-shard tier in Ray namespace %r",
             serving["decode_config"]["model_loading_config"].get("model_id"), config.num_shards,
             config.ray_namespace)
    return build_pd_openai_app(serving)
