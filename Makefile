# The commands of the README. install/demo/test/bench install into the active Python environment.
PYTHON ?= python
NPROC ?= 4

.PHONY: install demo test test-compat bench gpu-check

# the exact versions CI tests (transformers' newest tested release and what it needs)
CONSTRAINTS ?= .ci/constraints-newest.txt

install:
	$(PYTHON) -m pip install -c $(CONSTRAINTS) -e ".[test]"

demo: install
	$(PYTHON) -m torch.distributed.run --nproc-per-node $(NPROC) examples/train_llama.py --hp 2 --cp 2 --plot loss.png

test: install
	$(PYTHON) -m pytest -q --durations=15

bench: install
	$(PYTHON) benchmarks/compile_overhead.py

# The compatibility subset on another torch, in a cached venv (.ci/compat), with the pins of the
# transformers end CI pairs it with: make test-compat TORCH=2.11.0 CONSTRAINTS=.ci/constraints-oldest.txt
TORCH ?= 2.15.0
test-compat:
	.ci/compat $(TORCH) all $(CONSTRAINTS)

# The CUDA paths on this machine's GPU, offline: no build isolation, no dependency downloads.
GPU_CHECK_OUT ?= gpu-check
gpu-check:
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .
	$(PYTHON) -m loong_compile.gpu_check --out $(GPU_CHECK_OUT)
