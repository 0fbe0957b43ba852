"""Ray Serve launch: ``import_path: ucm_ray.serve:build_app`` (or ``build_pd_app`` for
prefill/decode disaggregation) in a Serve config."""

from ucm_ray.serve.app import build_app, prepare_app
from ucm_ray.serve.pd import build_pd_app, prepare_pd_app

__all__ = ["build_app", "build_pd_app", "prepare_app", "prepare_pd_app"]
