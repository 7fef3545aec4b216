# The two commands of the README:
#   make run   installs what is needed, builds the extension, runs the benchmarks (main job):
#              collectives, then training steps (DDP, FSDP2; short)
#   make test  builds if needed, compiles the CUDA path with nvcc where found, runs the test suite
PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0

.PHONY: run test deps build bench clean check-torch

deps:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "torch==$(TORCH_VERSION)"
	$(PIP) install -q -r requirements-dev.txt

# The extension is installed again only when a source or setup.py changed: pip's editable install
# compiles every file again, in a fresh temporary folder, each time it runs.
EXT_STAMP := build/installed.stamp
build: deps $(EXT_STAMP)

$(EXT_STAMP): setup.py $(shell find csrc -type f)
	$(PIP) install --no-build-isolation -e . -q
	@mkdir -p build && touch $@

run: build bench

bench:
	$(PYTHON) benchmarks/bench.py
	$(PYTHON) benchmarks/training.py --short

test: build
	PYTHON=$(PYTHON) bash tools/check_cuda_compile.sh
	cd tests && $(PYTHON) -m pytest -q

# The suite against another torch, in a virtual environment of its own (CI stays on $(TORCH_VERSION)):
#   make check-torch TORCH=2.14.1
check-torch:
	bash tools/check_torch.sh $(TORCH)

clean:
	rm -rf build *.egg-info torch_hca/*.so
