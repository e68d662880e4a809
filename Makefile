# Both targets build .venv with Python >= 3.12 on a fresh machine, install staronnx into it,
# then run the demo / the tests.
VENV   := .venv
PYTHON := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test docs venv clean

demo: $(STAMP)
	$(VENV)/bin/staronnx demo

# The suite runs on TEST_WORKERS pytest-xdist workers: its tests mostly wait on servers, threads
# and subprocesses, so more workers than cores pays. Each module runs on one worker (its fixtures
# made once; see tests/conftest.py); `make test TEST_WORKERS=0` runs it in this one process.
TEST_WORKERS ?= 4

# mypy first (mypy.ini: the whole package, strict), then the suite.
# The package's bytecode is compiled first: the suite starts ~450 Python processes, and where the
# environment sets PYTHONDONTWRITEBYTECODE (this project's machines do) each of them otherwise
# compiled staronnx's sources again, ~0.2 s of CPU apiece (an editable install leaves no .pyc)
test: $(STAMP)
	$(VENV)/bin/mypy
	$(PYTHON) -m compileall -q -j 0 staronnx >/dev/null
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# The documentation site: its figures from a small real run (about a minute), then a strict
# build into site/ (a broken link or a missing page fails it). `make test` builds it strict too
# (tests/test_docs.py), without remaking figures that exist.
docs: $(STAMP)
	$(PYTHON) docs/gen_figures.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

venv: $(STAMP)

# pyenv's python3.12 shim exists but fails when 3.12 is not the selected version, so every
# candidate is tried for real before it is used.
$(PYTHON):
	@py=""; for c in python3.12 python3.13 $$HOME/.pyenv/versions/3.12*/bin/python3.12 \
	    $$HOME/.pyenv/versions/3.13*/bin/python3.13 /usr/bin/python3.12 /usr/local/bin/python3.12; do \
	  if $$c -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1; then py=$$c; break; fi; \
	done; \
	if [ -z "$$py" ]; then echo "staronnx needs Python >= 3.12 (python3.12 not found)" >&2; exit 1; fi; \
	echo "creating $(VENV) with $$py"; $$py -m venv $(VENV)

$(STAMP): $(PYTHON) pyproject.toml
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q -e '.[dev]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info site docs/figures
