# dflash-pipeline: every target is a one-liner that delegates (see README.md, docs/reference/make-targets.md).
#   make demo   - set up if needed, then `dvc repro` the whole pipeline on the embedded tiny target (CPU)
#   make demo-hybrid - the same DAG on a tiny Gated DeltaNet hybrid target, in build/demo-hybrid/ -> reports/hybrid/
#   make test   - set up if needed, then the test suite
#   make report - the run as ONE self-contained HTML page (reports/report.html; the last stage of make demo)
#   make docs   - the documentation site into site/ (mkdocs build --strict)
#   GPU host (docs/guides/gpu-host.md): make image, make remote BUCKET=..., make pull, make repro-gpu, make push
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
export PATH := $(abspath $(VENV))/bin:$(PATH)
# torch==2.13.0+cpu is not on PyPI. pip finds it in a local wheel folder (pip's find-links) on our machines;
# elsewhere: make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PIP_EXTRA := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
# uv installs the same lock ~5x faster than pip (23 s vs ~110 s here). It does not read pip's config, so pip's
# local wheel folder is handed over; pip stays the fallback when uv cannot install the lock.
UV_VERSION ?= 0.13.9
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell python3 -m pip config get global.find-links 2>/dev/null))
UV_EXTRA := $(foreach d,$(FIND_LINKS),--find-links $(d)) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) --index-strategy unsafe-best-match,)
PARAMS ?= params.yaml
GPU_OVERLAY ?= params/gpu-qwen3.6-27b.yaml
IMAGE ?= dflash-pipeline:gpu
WITH_FLASH_ATTN ?= 0
REMOTE ?= storage

.PHONY: setup demo demo-hybrid repro report plots-offline test test-fast lint docs plan clean-venv image image-pin repro-gpu gpu-shell gpu-run remote push pull

setup: $(STAMP)

# One command installs the whole locked CPU set (--no-deps: exactly the lock, nothing re-added), then the four
# packages that break `import transformers` on this CPU torch are removed if present.
$(STAMP): requirements/cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q uv==$(UV_VERSION) 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
	$(VENV)/bin/uv pip install -q --python $(PY) --no-deps --compile-bytecode $(UV_EXTRA) -r requirements/cpu.txt \
	  || $(PY) -m pip install -q --no-deps $(PIP_EXTRA) -r requirements/cpu.txt 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>&1 | { grep -v "not installed" || true; }
	$(PY) -c "import torch, transformers, vllm, pyarrow, dvc; print('setup ok: torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
	touch $(STAMP)

demo: $(STAMP)
	dvc repro

repro: $(STAMP)
	dvc repro

# The hybrid demo in its own pipeline folder, so that params.yaml and dvc.lock here stay the dense demo's:
# the tracked tree (reports/ left out) is copied into HYBRID_DIR (git-ignored), the overlay is written into
# that copy's params.yaml and committed in the copy's own git repo (dvclive needs a commit), the DVC cache is
# shared, and the copy's dvc.lock starts from reports/hybrid/dvc.lock when there is one (else the copy keeps its own).
HYBRID_OVERLAY ?= params/demo-hybrid.yaml
HYBRID_DIR ?= build/demo-hybrid
HYBRID_REPORTS ?= reports/hybrid
demo-hybrid: $(STAMP)
	mkdir -p $(HYBRID_DIR)
	git ls-files -z | grep -zv '^reports/' | tar --null -T - -cf - | tar -xf - -C $(HYBRID_DIR)
	if [ -f $(HYBRID_REPORTS)/dvc.lock ]; then cp $(HYBRID_REPORTS)/dvc.lock $(HYBRID_DIR)/dvc.lock; fi
	cd $(HYBRID_DIR) && { [ -d .git ] || git init -q; } && python -m dflash.core.overlay $(HYBRID_OVERLAY) \
	  && git add -A && git -c user.name=demo-hybrid -c user.email=demo-hybrid@localhost commit -q --allow-empty -m copy \
	  && dvc cache dir --local $(abspath .dvc/cache) && dvc repro
	rm -rf $(HYBRID_REPORTS) && mkdir -p $(HYBRID_REPORTS)
	cp -r $(HYBRID_DIR)/reports/. $(HYBRID_REPORTS)/ && cp $(HYBRID_DIR)/dvc.lock $(HYBRID_REPORTS)/dvc.lock

# Two pytest-xdist workers, one test file each at a time (a file's module fixtures, such as its vLLM engines, stay
# on one worker), in the order tests/conftest.py collects them: the longest integration files first.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: $(STAMP)
	$(PY) -m pytest -q $(XDIST)

# The unit folder: every test there is fast (tests/conftest.py refuses a `slow` mark outside tests/integration/).
test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) tests/unit

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/hadolint docker/Dockerfile
	$(PY) docker/base_image.py check

# The documentation site (mkdocs.yml, docs/) into site/, strict: a broken link or anchor, or a page outside the nav,
# fails it. NO_MKDOCS_2_WARNING silences mkdocs-material's banner about its own successor.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

plan: $(STAMP)
	python -m stages.plan --params $(PARAMS)

# The report stage alone, on whatever the stages have written so far (dvc repro runs it after every other stage).
report: $(STAMP)
	python -m stages.report --params $(PARAMS)

# Rewrite the offline `dvc plots show` page template (.dvc/config's plots.html_template) from the pinned vl-convert.
plots-offline: $(STAMP)
	python -m dflash.core.figures dvc-template .dvc/plots_offline.html

clean-venv:
	rm -rf $(VENV)

# ---- GPU host: the pinned CUDA 13 image (docker/), runs with all GPUs and this checkout mounted -----------
image:
	python3 docker/base_image.py check && docker build -f docker/Dockerfile -t $(IMAGE) --build-arg WITH_FLASH_ATTN=$(WITH_FLASH_ATTN) .

# Re-pin the base on a host with Docker: docker pull + docker inspect RepoDigests -> docker/base-image.digest + FROM.
image-pin:
	python3 docker/base_image.py pin $(TAG)

# dvc repro reads only params.yaml: write the GPU overlay into it (dflash.core.overlay keeps comments), then repro.
repro-gpu:
	docker/run.sh $(IMAGE) bash -c 'python -m dflash.core.overlay $(GPU_OVERLAY) && dvc repro $(ARGS)'

gpu-shell:
	docker/run.sh $(IMAGE) bash

gpu-run:
	docker/run.sh $(IMAGE) bash -c '$(CMD)'

# ---- S3 remote (DVC). Needs only `dvc` on PATH (.venv after `make setup`, or inside the image via gpu-run). --
# Writes the remote to .dvc/config.local (git-ignored). Credentials: AWS env vars or ~/.aws, never here.
remote:
	$(if $(BUCKET),,$(error usage: make remote BUCKET=bucket[/prefix] [ENDPOINT=https://s3.example.com] [REMOTE=name]))
	dvc remote add --local -d -f $(REMOTE) s3://$(BUCKET)
	$(if $(ENDPOINT),dvc remote modify --local $(REMOTE) endpointurl $(ENDPOINT),true)

push:
	dvc push --run-cache

pull:
	dvc pull --run-cache
