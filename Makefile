# make          build the compiled custom ops (CMake) into custom_ops/lib/
# make setup    install Python requirements (keeps an installed torch)
# make test     setup + build + the whole test suite
# make train    setup + build + the demo pre-training run
# make bench    setup + build + every benchmark (figures land in bench/results/)
# make squad-demo  setup + build + a small generated SQuAD v1.1/v2.0 train/dev pair and its vocab
#               (demo_data/squad/, the files configs/squad_tiny.json reads)
PYTHON ?= python3
BUILD_DIR ?= build
OPS_LIB_DIR ?= $(CURDIR)/custom_ops/lib
SETUP_STAMP := .setup.stamp
PYTEST_ARGS ?=

.PHONY: all ops cuda-check setup test train bench squad-demo summary clean

all: ops

$(SETUP_STAMP): requirements.txt
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -r requirements.txt
	touch $@

setup: $(SETUP_STAMP)

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
test: ops
	$(PYTHON) -c "import custom_ops; custom_ops.load_library(required=True)"
	$(PYTHON) -m pytest tests $(PYTEST_ARGS)

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

bench: ops
	$(PYTHON) bench/ops.py
	$(PYTHON) bench/data.py
	$(PYTHON) bench/train_throughput.py

summary: $(SETUP_STAMP)
	$(PYTHON) bert.py --config configs/groupbert_large.json --summary

clean:
	rm -rf $(BUILD_DIR) custom_ops/lib $(SETUP_STAMP)
