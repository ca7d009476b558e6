PY ?= python3

.PHONY: install demo test

# The CPU build of torch is pinned when no torch is present (any other request pulls CUDA).
install:
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"

demo: install
	$(PY) -m tokenspeed demo

test: install
	$(PY) -m pytest -q -p no:cacheprovider
