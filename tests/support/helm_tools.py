"""Helm for the chart checks: the binary (``make helm-bin``), rendering, sizes, KubeRay's CRD schemas."""

from __future__ import annotations

import functools
import os
import re
import subprocess
from collections.abc import Iterable
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import ROOT
from ucm_ray.serve.check import PREPARE, load_serve_config

CHART = ROOT / "helm" / "ucm-ray"
CI_VALUES = CHART / "ci"
HELM_ENV = "UCM_RAY_HELM"
CRDS_ENV = "UCM_RAY_KUBERAY_CRDS"
DEFAULT_CRDS = ROOT.parent / "shared" / "kuberay-crds"
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.cache
def helm_binary() -> str:
    """``$UCM_RAY_HELM``, else the one ``make helm-bin`` caches (fetched now if missing)."""
    if os.environ.get(HELM_ENV):
        return os.environ[HELM_ENV]
    cached = ROOT / ".cache" / "helm" / "helm"
    if not os.access(cached, os.X_OK):
        done = subprocess.run(["make", "-s", "helm-bin"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            pytest.fail(f"make helm-bin failed (set {HELM_ENV} to a helm 3.18+/4 binary instead):\n"
                        f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return str(cached)


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=60)


def _value_args(values: Iterable[str | Path], sets: Iterable[str], set_strings: Iterable[str]) -> list[str]:
    args: list[str] = []
    for f in values:
        args += ["-f", str(f)]
    for s in sets:
        args += ["--set", s]
    for s in set_strings:
        args += ["--set-string", s]
    return args


def template(*values: str | Path, sets: Iterable[str] = (), set_strings: Iterable[str] = (),
             release: str = "ucm-ray") -> subprocess.CompletedProcess[str]:
    return helm("template", release, str(CHART), *_value_args(values, sets, set_strings))


def render(*values: str | Path, sets: Iterable[str] = (), set_strings: Iterable[str] = (),
           release: str = "ucm-ray") -> list[dict[str, Any]]:
    done = template(*values, sets=sets, set_strings=set_strings, release=release)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.load_all(done.stdout, Loader=_Loader) if d]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[o['kind'] for o in objects]}"
    return found[0]


_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity_bytes(value: int | str) -> int:
    """A Kubernetes memory quantity (the forms the chart writes and reads) in bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)(k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?", value)
    assert m, f"not a quantity: {value!r}"
    size = Fraction(m.group(1)) * _UNITS[m.group(2) or ""]
    assert size.denominator == 1, value
    return int(size)


def crd_dir() -> Path | None:
    """KubeRay's CRDs (test data, never copied into the project): ``$UCM_RAY_KUBERAY_CRDS``, else
    ../shared/kuberay-crds beside the checkout; None when neither exists."""
    if os.environ.get(CRDS_ENV):
        path = Path(os.environ[CRDS_ENV])
        assert path.is_dir(), f"{CRDS_ENV}={path} is not a directory"
        return path
    return DEFAULT_CRDS if DEFAULT_CRDS.is_dir() else None


@functools.cache
def crd_schema(plural: str, version: str = "v1") -> dict[str, Any]:
    """``openAPIV3Schema`` of ``ray.io_<plural>.yaml`` for ``version``."""
    path = crd_dir()
    if path is None:
        pytest.fail(f"KubeRay CRDs (test data) not found at {DEFAULT_CRDS}: set {CRDS_ENV} to their folder")
    docs = [d for d in yaml.load_all((path / f"ray.io_{plural}.yaml").read_text(), Loader=_Loader) if d]
    crd = next(d for d in docs if d.get("kind") == "CustomResourceDefinition")
    return next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]


VALUES = {"defaults": (), "gpu": (CI_VALUES / "gpu-values.yaml",),
          "autoscaling": (CI_VALUES / "autoscaling-values.yaml",), "pd": (CI_VALUES / "pd-values.yaml",)}
"""The ci value files each chart check renders with, by name."""


def group_values(name: str) -> dict:
    """The chart's values with a ci file merged in, as Helm merges them (maps deeply)."""
    def merge(base: dict, top: dict) -> dict:
        return {**base, **{k: merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
                           for k, v in top.items()}}

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for f in VALUES[name]:
        values = merge(values, yaml.safe_load(Path(f).read_text()) or {})
    return values


def serve_app(rayservice: dict, tmp_path: Path) -> dict:
    """serveConfigV2 through the code path of `serve run` / `ucm-ray serve`: Serve's schema first."""
    path = tmp_path / "serve.yaml"
    path.write_text(rayservice["spec"]["serveConfigV2"])
    config = load_serve_config(path)
    (app,) = config["applications"]
    assert app["import_path"] in PREPARE
    return app
