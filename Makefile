# ddplab: `make lab` opens the course, `make test` checks everything. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.ddplab-installed
export MPLBACKEND ?= Agg
# JupyterLab refuses to run as root unless told to.
ROOT_FLAG := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)
NB_TIMEOUT ?= 600

.PHONY: setup lock lab test test-cold test-fast test-unit test-soak test-notebooks course bench \
	strip test-browser test-compat test-newest test-gpu test-flakes clean

LOCK   := requirements/lock.txt
UV     := uv==0.13.9
TOOLS  := .venv-tools

setup: $(STAMP)

# The tested set: every package of .[lab,test] at the version in the lock (hashes checked), then
# ddplab itself, editable. Re-installs only when the lock or pyproject.toml changes.
$(STAMP): $(LOCK) pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --require-hashes -r $(LOCK)
	$(BIN)/python -m pip install -q --no-deps -e .
	@touch $(STAMP)

# Resolve the lock again: the newest versions pyproject.toml allows, around the torch pinned in
# requirements/pins.txt, for every platform and Python >= 3.10 (uv's universal resolution keeps
# each package's platform markers). uv lives in a venv of its own, outside the locked set.
lock:
	@test -x $(TOOLS)/bin/python || $(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install -q '$(UV)'
	$(TOOLS)/bin/python -m uv pip compile pyproject.toml --extra lab --extra test --universal \
		--python-version 3.10 -c requirements/pins.txt --generate-hashes \
		--custom-compile-command 'make lock' --quiet -o $(LOCK)

# The course's own JupyterLab settings (ddplab/lab/jupyter/labconfig: no news pop-up, no update
# check), shipped with the package, so `ddplab lab` applies them too.
lab: setup
	MPLBACKEND=module://matplotlib_inline.backend_inline \
	JUPYTER_CONFIG_PATH="$(CURDIR)/ddplab/lab/jupyter$${JUPYTER_CONFIG_PATH:+:$$JUPYTER_CONFIG_PATH}" \
	$(BIN)/jupyter lab --notebook-dir=notebooks --ip=127.0.0.1 $(ROOT_FLAG)

# pytest-xdist spreads whole files over XDIST workers (a file's tests run in order, in one
# worker), in the order they are named (--no-loadscope-reorder: xdist would otherwise sort them
# by their number of tests): LONGEST first, the files that took longest in a profiled run, so
# that no long file starts last and runs alone at the end; then every other notebook and test
# (a file named twice runs once).
# PYTEST_EXIT turns pytest's exit status 5 (nothing collected) into a failure that says so.
XDIST ?= -n 3 --dist loadfile --no-loadscope-reorder  # loadfile: a notebook's cells share a kernel
LONGEST := $(wildcard tests/test_launch.py tests/test_rank_behaviour.py tests/test_spawn_engine.py \
	tests/test_exercise_variants.py notebooks/03_*.ipynb notebooks/09_*.ipynb tests/test_cli.py \
	notebooks/10_*.ipynb notebooks/13_*.ipynb tests/test_env.py tests/test_cuda_clean.py \
	tests/test_check.py notebooks/07b_*.ipynb tests/test_train_worker.py \
	tests/test_workers_02_07_09.py tests/test_demos_spawning.py notebooks/03b_*.ipynb \
	notebooks/09b_*.ipynb tests/test_exit_abort.py notebooks/06_*.ipynb notebooks/11_*.ipynb)
NBVAL := --nbval-lax --nbval-current-env --nbval-cell-timeout=$(NB_TIMEOUT)
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider
PYTEST_EXIT = s=$$?; [ $$s -ne 5 ] || echo "make $@: pytest collected no tests: a failure here" >&2; exit $$s

# Test runs keep the doctor's cached facts (ddplab/env.py) in a folder of their own, not in the
# user's ~/.cache/ddplab.
test test-cold test-fast test-unit test-soak test-flakes test-notebooks test-browser test-compat \
	test-gpu: export DDPLAB_CACHE_DIR ?= $(CURDIR)/build/test-cache

# Everything CI runs before its optional steps: every unit test and every notebook in one
# parallel run, then the few tests that need the whole machine (marked serial), alone.
test: setup
	$(PYTEST) $(XDIST) -m "not soak and not serial" --durations=15 $(NBVAL) $(LONGEST) \
		notebooks tests --ignore=tests/browser || { $(PYTEST_EXIT); }
	$(PYTEST) -m "serial and not soak" tests --ignore=tests/browser || { $(PYTEST_EXIT); }

# make test with every launch a cold torchrun subprocess (no fork): the path macOS and Windows get.
test-cold:
	DDPLAB_LAUNCH_PATH=subprocess $(MAKE) test

# For contributors, under 90 s: the unit tests that start no process (not marked slow or
# launch), then one smoke launch per engine (tests/test_smoke.py).
test-fast: setup
	$(PYTEST) $(XDIST) -m "not slow and not launch and not soak" tests --ignore=tests/browser \
		|| { $(PYTEST_EXIT); }
	$(PYTEST) tests/test_smoke.py || { $(PYTEST_EXIT); }

test-unit: setup
	$(PYTEST) $(XDIST) -m "not soak and not serial" --durations=10 tests --ignore=tests/browser \
		|| { $(PYTEST_EXIT); }
	$(PYTEST) -m "serial and not soak" tests --ignore=tests/browser || { $(PYTEST_EXIT); }

# The same launches many times in a row (30 of the spawn worker, 30 of the training worker:
# none may abort at exit). About 5 minutes; .ci/run runs it after make test.
test-soak: setup
	$(PYTEST) -m soak tests --ignore=tests/browser || { $(PYTEST_EXIT); }

# The tests that flaked on a loaded two-core machine, RUNS times in a row under a load of two
# busy cores (stress-ng --cpu 2 where installed): benchmarks/flakes.sh. Long: minutes a run.
RUNS ?= 10
test-flakes: setup
	PYTHON=$(BIN)/python bash benchmarks/flakes.sh $(RUNS)

test-notebooks: setup
	$(PYTEST) $(XDIST) $(NBVAL) notebooks || { $(PYTEST_EXIT); }

# The course in JupyterLab, driven by headless Chromium (Debian's chromium; never a browser
# download). Installs what it needs first; screenshots go to build/browser/.
test-browser: setup
	bash tests/browser/setup.sh $(BIN)/python
	DDPLAB_BROWSER=1 $(BIN)/python -m pytest -q -rP -p no:cacheprovider tests/browser

# The launcher, training, collectives and parallelism tests and notebooks 03, 03b, 07, 07b, 08,
# 10, 11 and 12 (spawn, torchrun and two nodes, 4-rank collectives, hangs and timeouts, FSDP, comm
# hooks, compile, DCP, tensor parallel) on another torch
# release, in a venv of its own (.venv-compat-TORCH, built once): the floor by default, any
# release with `make test-compat TORCH=2.15.0`. tests/compat/venv.sh picks the torchvision.
TORCH ?= 2.6.0
COMPAT_VENV = .venv-compat-$(TORCH)
COMPAT_TESTS = tests/test_launch.py tests/test_public_torch_api.py tests/test_cli.py \
	tests/test_cuda_clean.py tests/test_rank_behaviour.py tests/test_train_worker.py \
	tests/test_train.py tests/test_amp.py tests/test_schedule.py tests/test_dist.py \
	tests/test_collectives.py tests/test_fork_safety.py tests/test_spawn_engine.py \
	tests/test_tensor_parallel.py tests/test_distributed_checkpoint.py tests/test_comm_hooks.py \
	tests/test_compile_ddp.py tests/test_torch_words.py tests/compat
COMPAT_NOTEBOOKS = $(wildcard notebooks/03*_*.ipynb notebooks/07*_*.ipynb notebooks/08_*.ipynb \
	notebooks/10_*.ipynb notebooks/11_*.ipynb notebooks/12_*.ipynb)

# The tests stop after COMPAT_TIMEOUT seconds whatever hangs (a stuck job would hold CI).
COMPAT_TIMEOUT ?= 1800

test-compat:
	bash tests/compat/venv.sh $(PYTHON) $(TORCH) $(COMPAT_VENV)
	timeout --kill-after=30 $(COMPAT_TIMEOUT) $(COMPAT_VENV)/bin/python -m pytest -q \
		-p no:cacheprovider --nbval-lax --nbval-current-env --nbval-cell-timeout=$(NB_TIMEOUT) \
		$(COMPAT_TESTS) $(COMPAT_NOTEBOOKS) || { s=$$?; [ $$s -ne 124 ] || \
		echo "make test-compat: stopped after $(COMPAT_TIMEOUT) s (COMPAT_TIMEOUT)" >&2; exit $$s; }

# The same set on the newest torch release PyPI serves today, whatever it is (drift, found on
# purpose before a learner finds it). .ci/run tests the newest release known to pass, NEWEST.
NEWEST ?= 2.15.0
test-newest:
	$(MAKE) test-compat TORCH=latest

# The launcher suite and every notebook on 2 or more GPUs (nccl); elsewhere one line says why
# it did nothing. Counts GPUs with nvidia-smi and a subprocess, never CUDA in this python.
test-gpu: setup
	$(BIN)/python tests/gpu/run.py

# Every notebook executed headless, with outputs, into build/ for reading.
course: setup
	$(BIN)/python -m ddplab course

bench: setup
	$(BIN)/python -c "import accelerate" 2>/dev/null || $(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/run_all.py

# Strip outputs and trim metadata of every notebook (run before committing notebooks).
strip: setup
	$(BIN)/python -m ddplab course --strip

clean:
	rm -rf build .pytest_cache
