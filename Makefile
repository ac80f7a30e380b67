# Two commands on a fresh machine: `make train` and `make test`; `make lab` to explore.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# The stamp names the torch spec, so `make train TORCH_SPEC=...` reinstalls.
STAMP := $(VENV)/.installed-$(shell echo '$(TORCH_SPEC)' | tr -c 'A-Za-z0-9.\n' '_')
# The project's Jupyter kernel, inside .venv (cflib.lab says how it coexists with `python3`).
KERNEL := $(VENV)/share/jupyter/kernels/cflib/kernel.json
PARAMS ?= params/quickstart.yaml

.PHONY: setup train test test-fast test-gpu lab strip references screenshots

setup: $(STAMP) $(KERNEL)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[notebook,test,data]"
	rm -f $(VENV)/.installed-*
	touch $@

$(KERNEL): $(STAMP)
	$(PY) -m ipykernel install --sys-prefix --name cflib --display-name cflib

train: setup
	$(VENV)/bin/papermill notebooks/train_sft.ipynb outputs/train_sft.$(notdir $(basename $(PARAMS))).ipynb \
		-f $(PARAMS) --cwd notebooks --log-output

# One pytest worker per core and one more, at most 4: many tests wait on processes they started (torchrun, notebook
# kernels, JupyterLab), and the extra worker uses the cores meanwhile. A test file (a notebook's cells among them)
# stays on one worker, and the files are handed out in the order tests/conftest.py gives them: those that start
# processes (notebooks, torchrun, papermill, JupyterLab) first, so that the last files to finish are short. The research probes' quick checks (benchmarks/tests) run here, never in test-fast.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min((os.cpu_count() or 1) + 1, 4))")
test: setup
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --nbval-lax --nbval-current-env \
		notebooks tests benchmarks/tests

# The unit tests alone, in under two minutes on two cores: no notebooks (nbval), and none of the tests marked slow
# (torchrun, papermill, JupyterLab, the browser); the DURATIONS slowest are named at the end, to be marked when they
# grow.
DURATIONS ?= 10
test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not slow" --durations=$(DURATIONS) tests

# On a CUDA machine, with the Python that has torch and the project's requirements (no .venv is made): the kernel,
# model, export, data and training tests and validate_kernels' checks, with the fast kernels compiled for the GPU
# instead of interpreted.
GPU_PYTHON ?= python3
GPU_WORKERS ?= 8
test-gpu:
	@$(GPU_PYTHON) -c "import sys, torch; sys.exit(None if torch.cuda.is_available() else 'make test-gpu: no CUDA device (make test runs the kernels in Triton\'s interpreter)')"
	$(GPU_PYTHON) -m pytest -q -p no:cacheprovider -rfE -n $(GPU_WORKERS) --dist loadfile tests/ops tests/model tests/export tests/data tests/train \
		tests/bench/test_validate.py

# JupyterLab on this machine (http://localhost:8888, token in the log); LAB_ARGS="--port 9999 ..." passes options on.
lab: setup
	$(PY) -m cflib.lab $(LAB_ARGS)

# Before committing a notebook saved in JupyterLab: outputs out (nbval's references stay), kernel name back to python3.
strip: setup
	$(PY) -m cflib.lab.nbclean notebooks/*.ipynb

# After a deliberate change to what a notebook's checked cells print (NBVAL_CHECK_OUTPUT): run it in place with its
# defaults, then strip it back to those references. NOTEBOOKS="notebooks/chat.ipynb" for one.
NOTEBOOKS ?= $(wildcard notebooks/*.ipynb)
references: setup
	for notebook in $(NOTEBOOKS); do $(VENV)/bin/papermill $$notebook $$notebook --cwd notebooks || exit 1; done
	$(PY) -m cflib.lab.nbclean $(NOTEBOOKS)

# The README's screenshots: the browser test's full-length shot of each notebook after its smoke run.
screenshots: setup
	rm -rf outputs/lab
	$(PY) -m pytest -q -p no:cacheprovider tests/lab/test_lab_browser.py
	mkdir -p outputs/screenshots && cp outputs/lab/*.png outputs/screenshots/
