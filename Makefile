# Two commands on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# The stamp names the torch spec, so `make train TORCH_SPEC=...` reinstalls.
STAMP := $(VENV)/.installed-$(shell echo '$(TORCH_SPEC)' | tr -c 'A-Za-z0-9.\n' '_')
PARAMS ?= params/quickstart.yaml

.PHONY: setup train test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[notebook,test]"
	rm -f $(VENV)/.installed-*
	touch $@

train: $(STAMP)
	$(VENV)/bin/papermill notebooks/train_sft.ipynb outputs/train_sft.$(notdir $(basename $(PARAMS))).ipynb \
		-f $(PARAMS) --cwd notebooks --log-output

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --nbval-lax --nbval-current-env tests notebooks

clean:
	rm -rf outputs/runs outputs/data outputs/*.ipynb
