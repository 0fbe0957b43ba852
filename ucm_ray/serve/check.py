"""Check a Serve config file before anything starts: Serve's own schema, then every
``ucm_ray.serve:build_app`` or ``build_pd_app`` application through its builder's validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ucm_ray.config import ConfigError
from ucm_ray.serve.app import prepare_app
from ucm_ray.serve.pd import prepare_pd_app

BUILDER = "ucm_ray.serve:build_app"
PD_BUILDER = "ucm_ray.serve:build_pd_app"
PREPARE = {BUILDER: prepare_app, PD_BUILDER: prepare_pd_app}


def load_serve_config(path: str | Path) -> dict[str, Any]:
    from ray.serve.schema import ServeDeploySchema

    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML: {str(e).splitlines()[0]}") from None
    try:
        ServeDeploySchema.model_validate(data)
    except ValueError as e:
        errors = getattr(e, "errors", None)
        first = errors()[0] if callable(errors) else {"loc": (), "msg": str(e)}
        raise ConfigError(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    return data


def check_serve_config(path: str | Path) -> str:
    """Raise ``ConfigError`` (one line) for the first mistake; return the HTTP endpoint."""
    data = load_serve_config(path)
    apps = [a for a in data.get("applications", []) if a.get("import_path") in PREPARE]
    if not apps:
        raise ConfigError(f"no application has import_path {BUILDER} or {PD_BUILDER}")
    for app in apps:
        try:
            PREPARE[app["import_path"]](app.get("args") or {})
        except ConfigError as e:
            raise ConfigError(f"application {app.get('name', '?')!r}: {e}") from None
    http = data.get("http_options") or {}
    return f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}"
