# make          build the compiled custom ops (CMake) into custom_ops/lib/
# make setup    install what the product needs (requirements.txt at the versions requirements.lock
#               pins; keeps an installed torch, else installs requirements-torch.txt's)
# make train    setup + build + the demo pre-training run
# make test     setup + the test, benchmark and lint requirements (requirements-dev.txt) + build
#               + the whole test suite; make test-fast: the tests not marked slow, a quarter of each fuzzer's examples
# make lint     the linter (ruff, pyflakes rules) over the project
# make bench    every benchmark bench/README.md's table cites, full runs (figures in bench/results/)
# make squad-demo  setup + build + a small generated SQuAD v1.1/v2.0 train/dev pair and its vocab
#               (demo_data/squad/, the files configs/squad_tiny.json reads)
# make gpu-check        on an NVIDIA machine, network or none: wheels, CUDA build, CUDA tests, GPU benchmarks
#                       within BUDGET_S seconds (docs/gpu.md);
#                       DRY_RUN=1: the same on the CPU at tiny sizes, into a temporary directory
# make gpu-wheels       download the wheels requirements-gpu.txt lists into .whl/ (carried to the GPU)
# make lock     compile requirements.lock again from requirements-dev.txt and requirements-torch.txt
#               (pip-tools in its own environment; UPGRADE=1 moves every pin to the newest release)
PYTHON ?= python3
BUILD_DIR ?= build
OPS_LIB_DIR ?= $(CURDIR)/custom_ops/lib
LOCK := requirements.lock
# The stamps name the environment they were made in (a hash of its sys.prefix): a new
# virtual environment in the same checkout is set up again, not taken for done.
ENV_KEY := $(shell $(PYTHON) -c 'import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:10])')
SETUP_STAMP := .setup-$(ENV_KEY).stamp
DEV_STAMP := .setup-dev-$(ENV_KEY).stamp
PYTEST_ARGS ?=

.PHONY: all ops cuda-check setup setup-dev test test-fast lint train bench squad-demo summary clean gpu-check \
	gpu-wheels lock

all: ops

# Every package, direct or transitive, at the version requirements.lock pins (-c): the
# environment a user gets is the one the tests ran in. torch is kept where one is installed.
$(SETUP_STAMP): requirements.txt requirements-torch.txt $(LOCK)
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -r requirements-torch.txt -c $(LOCK)
	$(PYTHON) -m pip install -r requirements.txt -c $(LOCK)
	touch $@

setup: $(SETUP_STAMP)

$(DEV_STAMP): $(SETUP_STAMP) requirements-dev.txt $(LOCK)
	$(PYTHON) -m pip install -r requirements-dev.txt -c $(LOCK)
	touch $@

setup-dev: $(DEV_STAMP)

ops: $(SETUP_STAMP)
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release -DGROUPBERT_OPS_OUTPUT_DIR="$(OPS_LIB_DIR)" \
		-DPython_EXECUTABLE="$$(command -v $(PYTHON))" \
		-DCMAKE_PREFIX_PATH="$$($(PYTHON) -c 'import torch; print(torch.utils.cmake_prefix_path)')"
	cmake --build $(BUILD_DIR) --parallel

# Compile every CUDA source with nvcc alone (no torch headers: the .cu files hold
# raw-pointer kernels and launchers), and every Triton kernel variant with Triton's own
# compiler (registers and spills), to catch errors on machines without a GPU.
NVCC ?= nvcc
CUDA_ARCH ?= sm_90
cuda-check:
	@for f in custom_ops/csrc/*.cu; do \
		echo "nvcc $$f"; $(NVCC) -std=c++17 -O3 -arch=$(CUDA_ARCH) -c $$f -o /dev/null || exit 1; \
	done
	@if $(PYTHON) -c "import torch, triton" 2>/dev/null; then $(PYTHON) -m custom_ops.triton_check; \
	else echo "Triton kernels not checked: $(PYTHON) has no torch or triton (make setup-dev, or PYTHON=...)"; exit 1; fi

# The compiled ops must load here, so their tests run rather than skip. The suite runs in two
# processes (pytest-xdist; most tests wait on one thread, an import or a child process) at the
# lowest priority, beside the tests marked serial (wall-clock fault timeouts) at the normal
# one (tests/run_suite.sh).
test: ops $(DEV_STAMP)
	$(PYTHON) -c "import custom_ops; custom_ops.load_library(required=True)"
	PYTHON=$(PYTHON) bash tests/run_suite.sh $(PYTEST_ARGS)

test-fast: ops $(DEV_STAMP)
	GROUPBERT_FUZZ_SCALE=0.25 $(PYTHON) -m pytest tests -m "not slow" $(PYTEST_ARGS)

LINTED := bert.py infer.py setup.py builder bert session custom_ops data fileio bench tests
lint: $(DEV_STAMP)
	$(PYTHON) -m ruff check --no-cache $(LINTED)

# The demo run, then its portable export filling masked words in onnxruntime. A run
# never reuses a directory (runs/demo, runs/demo.1, ...): export the newest.
train: ops
	$(PYTHON) bert.py train --config configs/demo.json
	@run=$$(ls -dt runs/demo runs/demo.[0-9]* 2>/dev/null | head -1); set -x; \
	$(PYTHON) bert.py export --config configs/demo.json --checkpoint-input $$run/checkpoint-final --output $$run/model.onnx && \
	$(PYTHON) infer.py --model $$run/model.onnx --task mlm --no-progress \
		--text "Brenmoor has a population of about 39000 [MASK]. The [MASK] of Brenmoor is based on farming."

# The SQuAD files configs/squad_tiny.json reads, generated from the demo corpus's documents
# (data/squad_demo.py; kept when they are there already).
squad-demo: ops
	$(PYTHON) -m data.squad_demo demo_data/squad

# Every benchmark bench/README.md's table cites, as full runs (about an hour on 2
# cores; figures into bench/results/*.json). Rows of the table, and the command each comes from:
#   BERT training vs HF; GroupBERT vs BERT               python bench/train_throughput.py
#   GroupedConv1d vs F.conv1d; fused LAMB vs its floor   python bench/ops.py
#   RTS state and live gradients; pipeline RSS; step time, 1 process vs 2 replicas
#                                                        python bench/scaling.py (its memory part too)
#   inference, onnxruntime vs HF eager                   python bench/inference.py
#   packed vs padded training                            python bench/packing.py
#   fine-tuning accuracy and entity F1 vs transformers   python bench/finetune_parity.py (about 40 minutes)
#   SQuAD fine-tuning vs transformers                    python bench/squad.py --train-file T --dev-file D
#   SQuAD features of one long context                   python bench/squad.py --features-only --dev-file D
#   data loader; create_pretraining_data                 python bench/input_pipeline.py
# The SQuAD rows read the official SQuAD v1.1 files (not shipped): SQUAD_TRAIN, SQUAD_DEV.
# Each benchmark's --smoke mode (seconds, no results file) runs in the suite instead
# (tests/test_bench_smoke.py).
SQUAD_TRAIN ?= data/squad/train-v1.1.json
SQUAD_DEV ?= data/squad/dev-v1.1.json
bench: ops $(DEV_STAMP)
	@test -f "$(SQUAD_TRAIN)" -a -f "$(SQUAD_DEV)" || { echo "make bench: the SQuAD rows read the official \
	SQuAD v1.1 files; $(SQUAD_TRAIN) or $(SQUAD_DEV) is missing: pass SQUAD_TRAIN=FILE SQUAD_DEV=FILE" >&2; exit 2; }
	$(PYTHON) bench/train_throughput.py
	$(PYTHON) bench/step_profile.py
	$(PYTHON) bench/ops.py
	$(PYTHON) bench/cross_entropy.py
	$(PYTHON) bench/scaling.py
	$(PYTHON) bench/inference.py
	$(PYTHON) bench/packing.py
	$(PYTHON) bench/finetune.py
	$(PYTHON) bench/finetune_parity.py
	$(PYTHON) bench/squad.py --train-file "$(SQUAD_TRAIN)" --dev-file "$(SQUAD_DEV)"
	$(PYTHON) bench/squad.py --features-only --dev-file "$(SQUAD_DEV)"
	$(PYTHON) bench/input_pipeline.py

# No setup or ops prerequisite: the GPU machine may have no registry, so the script installs
# what it lacks from .whl/ itself and builds the ops with CUDA (bench/gpu_check.py).
# BUDGET_S=S: the whole check's seconds; COPY_TO=DIR also copies the results there after every
# step; GPU_CHECK_OUT=DIR writes them there; ONLY=STEP[,STEP] reruns those steps into the
# committed record (bench/results/gpu.json).
gpu-check:
	$(PYTHON) bench/gpu_check.py $(if $(filter-out 0,$(DRY_RUN)),--dry-run) $(if $(ONLY),--only $(ONLY)) \
		$(if $(BUDGET_S),--budget-s $(BUDGET_S)) $(if $(COPY_TO),--copy-to "$(COPY_TO)") \
		$(if $(GPU_CHECK_OUT),--out-dir "$(GPU_CHECK_OUT)")

# The GPU machine's Python (GPU_PYTHON, default CPython 3.12) on manylinux x86-64.
GPU_PYTHON ?= 3.12
GPU_WHEEL_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
	manylinux1_x86_64
# Pinned packages whose PyPI release is a source archive alone: built into wheels here.
GPU_SOURCE_ONLY := seqeval
GPU_BINARY_PINS := .whl/binary-pins.txt
gpu-wheels: requirements-gpu.txt
	mkdir -p .whl && grep -v -E '^($(GPU_SOURCE_ONLY))==' requirements-gpu.txt > $(GPU_BINARY_PINS)
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		$(addprefix --platform ,$(GPU_WHEEL_PLATFORMS)) -d .whl -r $(GPU_BINARY_PINS)
	$(PYTHON) -m pip wheel --no-deps -q -w .whl $$(grep -E '^($(GPU_SOURCE_ONLY))==' requirements-gpu.txt)
	rm -f $(GPU_BINARY_PINS)

summary: $(SETUP_STAMP)
	$(PYTHON) bert.py summary --config configs/groupbert_large.json

# torch is left out of the lock (--unsafe-package): an installed torch, a CUDA build on GPU
# machines, must satisfy what needs it rather than be replaced; its own dependencies are pinned.
PIP_TOOLS := pip-tools==7.6.2
lock:
	$(PYTHON) -m venv --clear $(BUILD_DIR)/lock-env
	$(BUILD_DIR)/lock-env/bin/python -m pip install --quiet $(PIP_TOOLS)
	$(BUILD_DIR)/lock-env/bin/pip-compile --quiet --strip-extras --no-emit-index-url --no-emit-find-links \
		--no-emit-trusted-host --unsafe-package torch --unsafe-package pip $(if $(filter-out 0,$(UPGRADE)),--upgrade) \
		--output-file $(LOCK) requirements-dev.txt requirements-torch.txt

clean:
	rm -rf $(BUILD_DIR) custom_ops/lib .setup-*.stamp
