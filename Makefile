# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Both first create or refresh .venv with the pinned CPU stack. `make test-fast` is the quick
# loop while editing: ruff and the unit tier (tests/unit: no Ray, no engine, no training).

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.qerl-setup-done

.PHONY: setup demo test test-fast clean

setup: $(STAMP)

# Re-run when the declared dependencies change. The CUDA builds of torchvision/torchaudio/
# torchcodec that the registry pulls in break `import vllm` and `import peft` beside torch+cpu,
# and triton is unused on CPU: remove them.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[cpu,dev]"
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	@touch $(STAMP)

demo: setup
	$(BIN)/qerl train --config configs/tiny_cpu.yaml train.overwrite=true

# Lint first (ruff: errors and import order). pytest exits 5 when it collects nothing: for this
# suite that means something is broken.
PYTEST = $(BIN)/python -m pytest -q -rs --durations=25 $(1); status=$$?; \
	if [ $$status -eq 5 ]; then echo "make $@: pytest collected no tests" >&2; exit 1; fi; \
	exit $$status

test: setup
	$(BIN)/ruff check .
	@$(call PYTEST,)

test-fast: setup
	$(BIN)/ruff check .
	@$(call PYTEST,tests/unit)

clean:
	rm -rf $(VENV) runs
