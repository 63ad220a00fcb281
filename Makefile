# The two commands of the README. Both install into the active Python environment.
PYTHON ?= python
NPROC ?= 4

.PHONY: install demo test bench

install:
	$(PYTHON) -m pip install -e ".[test]"

demo: install
	$(PYTHON) -m torch.distributed.run --nproc-per-node $(NPROC) examples/train_llama.py --hp 2 --cp 2 --plot loss.png

test: install
	$(PYTHON) -m pytest -q --durations=15

bench: install
	$(PYTHON) benchmarks/compile_overhead.py
