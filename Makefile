# make          build the compiled custom ops (CMake) into custom_ops/lib/
# make setup    install what the product needs (requirements.txt; keeps an installed torch)
# make train    setup + build + the demo pre-training run
# make test     setup + the test, benchmark and lint requirements (requirements-dev.txt) + build
#               + the whole test suite; make test-fast: the tests not marked slow
# make lint     the linter (ruff, pyflakes rules) over the project
# make bench    the benchmarks the README's performance table cites (figures in bench/results/)
# make squad-demo  setup + build + a small generated SQuAD v1.1/v2.0 train/dev pair and its vocab
#               (demo_data/squad/, the files configs/squad_tiny.json reads)
# make gpu-check        on a lent GPU: wheels, CUDA build, CUDA tests, GPU benchmarks (docs/gpu.md);
#                       DRY_RUN=1: the same on the CPU at tiny sizes, into a temporary directory
# make gpu-wheels       download the wheels requirements-gpu.txt lists into .whl/ (carried to the GPU)
PYTHON ?= python3
BUILD_DIR ?= build
OPS_LIB_DIR ?= $(CURDIR)/custom_ops/lib
SETUP_STAMP := .setup.stamp
DEV_STAMP := .setup-dev.stamp
PYTEST_ARGS ?=

.PHONY: all ops cuda-check setup setup-dev test test-fast lint train bench squad-demo summary clean gpu-check \
	gpu-wheels

all: ops

$(SETUP_STAMP): requirements.txt
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -r requirements.txt
	touch $@

setup: $(SETUP_STAMP)

$(DEV_STAMP): $(SETUP_STAMP) requirements-dev.txt
	$(PYTHON) -m pip install -r requirements-dev.txt
	touch $@

setup-dev: $(DEV_STAMP)

ops: $(SETUP_STAMP)
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release -DGROUPBERT_OPS_OUTPUT_DIR="$(OPS_LIB_DIR)" \
		-DPython_EXECUTABLE="$$(command -v $(PYTHON))" \
		-DCMAKE_PREFIX_PATH="$$($(PYTHON) -c 'import torch; print(torch.utils.cmake_prefix_path)')"
	cmake --build $(BUILD_DIR) --parallel

# Compile every CUDA source with nvcc alone (no torch headers: the .cu files hold
# raw-pointer kernels and launchers), to catch errors on machines without a GPU.
NVCC ?= nvcc
CUDA_ARCH ?= sm_90
cuda-check:
	@for f in custom_ops/csrc/*.cu; do \
		echo "nvcc $$f"; $(NVCC) -std=c++17 -O3 -arch=$(CUDA_ARCH) -c $$f -o /dev/null || exit 1; \
	done

# The compiled ops must load here, so their tests run rather than skip.
test: ops $(DEV_STAMP)
	$(PYTHON) -c "import custom_ops; custom_ops.load_library(required=True)"
	$(PYTHON) -m pytest tests $(PYTEST_ARGS)

test-fast: ops $(DEV_STAMP)
	$(PYTHON) -m pytest tests -m "not slow" $(PYTEST_ARGS)

LINTED := bert.py infer.py setup.py builder bert session custom_ops data bench tests
lint: $(DEV_STAMP)
	$(PYTHON) -m ruff check --no-cache $(LINTED)

# The demo run, then its portable export filling masked words in onnxruntime. A run
# never reuses a directory (runs/demo, runs/demo.1, ...): export the newest.
train: ops
	$(PYTHON) bert.py --config configs/demo.json
	@run=$$(ls -dt runs/demo runs/demo.[0-9]* 2>/dev/null | head -1); set -x; \
	$(PYTHON) bert.py --config configs/demo.json --checkpoint-input $$run/checkpoint-final --export $$run/model.onnx && \
	$(PYTHON) infer.py --model $$run/model.onnx --task mlm --no-progress \
		--text "Brenmoor has a population of about 39000 [MASK]. The [MASK] of Brenmoor is based on farming."

# The SQuAD files configs/squad_tiny.json reads, generated from the demo corpus's documents
# (data/squad_demo.py; kept when they are there already).
squad-demo: ops
	$(PYTHON) -m data.squad_demo demo_data/squad

bench: ops $(DEV_STAMP)
	$(PYTHON) bench/ops.py
	$(PYTHON) bench/data.py
	$(PYTHON) bench/train_throughput.py

# No setup or ops prerequisite: a lent GPU machine has no registry, so the script installs
# what it lacks from .whl/ itself and builds the ops with CUDA (bench/gpu_check.py).
# COPY_TO=DIR also copies the results there after every step; GPU_CHECK_OUT=DIR writes them there.
gpu-check:
	$(PYTHON) bench/gpu_check.py $(if $(filter-out 0,$(DRY_RUN)),--dry-run) \
		$(if $(COPY_TO),--copy-to "$(COPY_TO)") $(if $(GPU_CHECK_OUT),--out-dir "$(GPU_CHECK_OUT)")

# The GPU machine's Python: CPython 3.12 on manylinux x86-64 (the device tool's README).
GPU_WHEEL_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
	manylinux1_x86_64
gpu-wheels: requirements-gpu.txt
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(addprefix --platform ,$(GPU_WHEEL_PLATFORMS)) -d .whl -r requirements-gpu.txt

summary: $(SETUP_STAMP)
	$(PYTHON) bert.py --config configs/groupbert_large.json --summary

clean:
	rm -rf $(BUILD_DIR) custom_ops/lib $(SETUP_STAMP) $(DEV_STAMP)
