"""The Serve app builder: Ray Serve LLM's OpenAI app whose engines share one tier.

``serve run`` calls ``build_app`` with the config file's ``args``: Ray Serve LLM's own
arguments (``llm_configs`` and the other ``LLMServingArgs`` keys, passed through) plus
a ``tier:`` section (the ``UcmRayConfig`` keys, and ``shards_per_node``). It

1. validates everything before anything starts (a bad value is one ``ConfigError`` line),
2. makes sure the shard fleet exists, ``shards_per_node`` shards on every node that can
   host one now (idempotent: another app or a restarted one finds the same shards by name),
3. gives every engine the connector's ``kv_transfer_config`` (a user-given one must name
   this connector; its keys win over the tier's), and a fixed ``PYTHONHASHSEED`` unless
   the user set one (vLLM 0.26 otherwise seeds block hashes per process: nothing shared),
   and, unless the user set them, vLLM's V1 model runner and synchronous scheduling (with
   either of the others a failed load is not recomputed exactly; the connector refuses them),
4. returns ``ray.serve.llm.build_openai_app`` of the result.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ucm_ray.config import ConfigError, UcmRayConfig

log = logging.getLogger(__name__)

CONNECTOR = "UcmRayConnector"
CONNECTOR_MODULE = "ucm_ray.vllm.connector"
HASH_SEED = "0"


@dataclass(frozen=True)
class Tier:
    """The ``tier:`` section: the fleet and engine settings, and how shards are placed."""

    config: UcmRayConfig
    shards_per_node: int | None
    """Shards on each node (the default, 1, unless ``num_shards`` is given: then that many,
    spread over the cluster)."""

    @classmethod
    def from_dict(cls, raw: Any) -> Tier:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"tier: expected a mapping of ucm-ray settings, got {raw!r}")
        raw = dict(raw)
        per_node = raw.pop("shards_per_node", None)
        if per_node is not None and "num_shards" in raw:
            raise ConfigError("tier: give num_shards (spread over the cluster) or shards_per_node, not both")
        if per_node is None and "num_shards" not in raw:
            per_node = 1
        if per_node is not None:
            if isinstance(per_node, bool) or not isinstance(per_node, int) or not 1 <= per_node <= 64:
                raise ConfigError(f"shards_per_node: {per_node!r} is not allowed; expected an integer from 1 to 64")
            # The fleet's size is known once it starts (nodes x per node, checked against
            # replication then); until then a stand-in that lets the other keys be validated.
            raw["num_shards"] = max(per_node, _as_int(raw.get("replication", 1)))
        return cls(UcmRayConfig.from_dict(raw), per_node)


def _as_int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def kv_transfer_config(config: UcmRayConfig, user: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """The engine's ``kv_transfer_config``: ours, with a user-given one's keys winning."""
    ours: dict[str, Any] = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
                            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                            "kv_connector_extra_config": config.to_dict()}
    if user is None:
        return ours
    if not isinstance(user, Mapping):
        raise ConfigError(f"{where}.kv_transfer_config: expected a mapping, got {user!r}")
    named = user.get("kv_connector", CONNECTOR)
    if named != CONNECTOR:
        raise ConfigError(f"{where}.kv_transfer_config names kv_connector {named!r}; this app runs {CONNECTOR} "
                          "(drop kv_transfer_config and the builder adds it, or use ray.serve.llm:build_openai_app)")
    module = user.get("kv_connector_module_path", CONNECTOR_MODULE)
    if module != CONNECTOR_MODULE:
        raise ConfigError(f"{where}.kv_transfer_config: kv_connector_module_path {module!r} "
                          f"is not {CONNECTOR_MODULE!r}")
    policy = user.get("kv_load_failure_policy", "recompute")
    if policy != "recompute":
        raise ConfigError(f"{where}.kv_transfer_config: kv_load_failure_policy {policy!r} is not allowed; "
                          "expected 'recompute' (a load that fails must never fail the request)")
    extra = user.get("kv_connector_extra_config") or {}
    if not isinstance(extra, Mapping):
        raise ConfigError(f"{where}.kv_transfer_config.kv_connector_extra_config: expected a mapping, got {extra!r}")
    merged = {**config.to_dict(), **extra}
    UcmRayConfig.from_dict(merged)  # one line naming the key if the user's value is wrong
    return {**ours, **user, "kv_connector_extra_config": merged}


def llm_config_dict(entry: Any, where: str) -> dict[str, Any]:
    """One engine's config as a plain dict (a dict, an LLMConfig or a YAML path); ``where``
    names it in errors (``llm_configs[0]``, ``prefill_config``)."""
    from ray.serve.llm import LLMConfig

    if isinstance(entry, str):
        if not os.path.exists(entry):
            raise ConfigError(f"{where}: file {entry} does not exist")
        entry = LLMConfig.from_file(entry)
    if isinstance(entry, LLMConfig):
        return entry.model_dump(exclude_unset=True)
    if isinstance(entry, Mapping):
        return copy.deepcopy(dict(entry))
    raise ConfigError(f"{where}: expected a mapping or an LLMConfig, got {type(entry).__name__}")


def with_connector(entry: dict[str, Any], config: UcmRayConfig, label: str) -> dict[str, Any]:
    """The engine config with this tier's connector, prefix caching on, a fixed hash seed and vLLM's
    V1 model runner (``compat.check_model_runner``) unless the user set them; scheduling stays
    vLLM's (or the user's) choice: under asynchronous scheduling the connector loads hits before
    their requests are scheduled (``compat.loads_land_before_scheduling``)."""
    from ucm_ray.vllm.compat import EXACT_RECOVERY_ENV  # vLLM: when built only
    model = (entry.get("model_loading_config") or {}).get("model_id", "?")
    where = f"{label} ({model}).engine_kwargs"
    engine_kwargs = dict(entry.get("engine_kwargs") or {})
    engine_kwargs["kv_transfer_config"] = kv_transfer_config(config, engine_kwargs.get("kv_transfer_config"), where)
    engine_kwargs.setdefault("enable_prefix_caching", True)
    if engine_kwargs["enable_prefix_caching"] is not True:
        raise ConfigError(f"{where}.enable_prefix_caching: the tier shares prefix-cached blocks; it must be true")
    runtime_env = dict(entry.get("runtime_env") or {})
    env_vars = {**EXACT_RECOVERY_ENV, **(runtime_env.get("env_vars") or {})}
    env_vars.setdefault("PYTHONHASHSEED", HASH_SEED)
    runtime_env["env_vars"] = env_vars
    return {**entry, "engine_kwargs": engine_kwargs, "runtime_env": runtime_env}


def prepare_app(args: Mapping[str, Any]) -> tuple[dict[str, Any], Tier]:
    """Validate ``args``; return ``build_openai_app``'s arguments (the connector added to
    every engine) and the tier. Starts nothing (tests and the Helm chart's checks use it)."""
    if not isinstance(args, Mapping):
        raise ConfigError(f"app args: expected a mapping with llm_configs and tier, got {args!r}")
    tier = Tier.from_dict(args.get("tier"))
    return serving_args(args, tier.config), tier


def serving_args(args: Mapping[str, Any], config: UcmRayConfig) -> dict[str, Any]:
    from ray.serve.llm import LLMServingArgs

    serving = {k: v for k, v in args.items() if k != "tier"}
    entries = serving.get("llm_configs")
    if not isinstance(entries, list) or not entries:
        raise ConfigError("llm_configs: expected a non-empty list of Ray Serve LLM configs")
    serving["llm_configs"] = [with_connector(llm_config_dict(e, f"llm_configs[{i}]"), config, f"llm_configs[{i}]")
                              for i, e in enumerate(entries)]
    validate(LLMServingArgs, serving, "llm_configs")
    return serving


def validate(schema: Any, serving: dict[str, Any], where: str) -> None:
    """Ray's own schema (``LLMServingArgs``, ``PDServingArgs``) over the result: its first complaint, one line."""
    try:
        schema.model_validate(serving)
    except ValueError as e:  # pydantic's ValidationError
        raise ConfigError(f"{where}: {first_error(e)}") from None


def first_error(error: ValueError) -> str:
    errors = getattr(error, "errors", None)
    if callable(errors):
        first = errors()[0]
        return f"{'.'.join(str(p) for p in first.get('loc', ()))}: {first.get('msg', '')}"
    return str(error).splitlines()[0]


def ensure_fleet(tier: Tier) -> UcmRayConfig:
    """Start (or find) the shard fleet; returns the config with the fleet's size."""
    from ucm_ray.store.shard.fleet import start_fleet, start_fleet_per_node

    if tier.shards_per_node is None:
        start_fleet(tier.config)
        return tier.config
    return start_fleet_per_node(tier.config, tier.shards_per_node)


def build_app(args: dict[str, Any]) -> Any:
    """Serve ``import_path`` target: validate, start the fleet, build the OpenAI app."""
    from ray.serve.llm import build_openai_app

    serving, tier = prepare_app(args)  # everything checked before anything starts
    config = ensure_fleet(tier)
    if config != tier.config:  # engines get the fleet's real size
        serving = serving_args(args, config)
    log.info("ucm-ray: %d engine config(s) share a %d-shard tier in Ray namespace %r",
             len(serving["llm_configs"]), config.num_shards, config.ray_namespace)
    return build_openai_app(serving)
