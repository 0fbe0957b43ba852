"""Ray Serve launch: ``import_path: ucm_ray.serve:build_app`` in a Serve config."""

from ucm_ray.serve.app import build_app, prepare_app

__all__ = ["build_app", "prepare_app"]
