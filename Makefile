# The two commands a new user needs: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 2

.PHONY: install demo finetune-demo digits test test-avx2 test-fast bench bench-speed bench-cpu gpu-check clean

# torch is pinned and installed first: the CPU wheel on this machine's disk. Letting pip
# resolve a bare `torch` would download a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# blockformer's C kernels and their C++ operators, built now rather than at a first decode or training step (10-20 s)
	$(PY) -c "from blockformer import native; native.load_cpp_ops(); native.load('causal_attention'); native.load('gelu')"
	touch $@

install: $(VENV)/.installed

# The demo replaces its own previous run (runs/stdlib-lm); `blockformer train` alone refuses to.
demo: install
	$(PY) -m blockformer train --preset stdlib-lm --overwrite

# Pre-train an encoder by masked-LM on the standard library, then fine-tune it to tell which
# stdlib package a function comes from (docs/finetuning.md; about 15 minutes on 2 cores).
finetune-demo: install
	$(PY) -m blockformer.data.stdlib_packages --out data/stdlib-packages
	$(PY) -m blockformer train --preset stdlib-mlm --overwrite
	$(PY) -m blockformer train --preset stdlib-packages --init-from runs/stdlib-mlm/best --overwrite
# Other inputs: a small ViT on scikit-learn's 8x8 digits, then its test accuracy (README "Other inputs").
digits: install
	$(PY) -m pip install -q -e '.[data]'
	$(PY) -m blockformer train --preset digits-vit --overwrite
	$(PY) -m blockformer predict --checkpoint runs/digits-vit --split test --output runs/digits-vit/test.jsonl

test: install
	$(PY) -m pytest -q

# The suite again as an AVX2-only CPU runs it: torch's kernels (ATEN), oneDNN's, MKL's (which
# ATEN_CPU_CAPABILITY does not reach) and blockformer's own CPU-feature choices capped at AVX2
# (no AVX-512, no bf16 units). CI runs both passes.
test-avx2: install
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 $(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

# Every benchmark in BENCHMARKS.md, one after another (about 80 minutes on 2 cores): two torch
# processes at once would slow each other several-fold.
bench: install
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/bench_tinyshakespeare.py --threads 2
	$(PY) benchmarks/bench_tasks.py --threads 2
	$(PY) benchmarks/bench_translate.py --threads 2 --max-minutes 30 --set train.keep_last=10 --set train.progress=false
	$(PY) benchmarks/bench_decode.py --threads 2 --dtype fp32 --out benchmarks/results/decode-fp32.md
	$(PY) benchmarks/bench_decode.py --threads 2 --dtype bf16 --skip nocache --repeats 3 --out benchmarks/results/decode-bf16.md
	$(PY) benchmarks/bench_finetune.py --threads 2
	$(PY) benchmarks/bench_lora_lm.py --threads 2
	$(PY) benchmarks/bench_inputs.py --threads 2

# The speed table of issue 12, one script at a time on a quiet machine (a GPU where there is one).
bench-speed: install
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m blockformer info --peak
	$(PY) benchmarks/bench_tinyshakespeare.py --threads 2 --precisions fp32 --compile
	$(PY) benchmarks/bench_gpt2_train.py --threads 2 --compile
	$(PY) benchmarks/bench_translate.py --threads 2 --max-minutes 15 --set train.compile=true --set train.progress=false
	$(PY) benchmarks/bench_decode.py --threads 2 --dtype bf16 --skip nocache int8-cache int8-compiled int4-cache int4-compiled --repeats 3 --out benchmarks/results/decode-bf16-speculative.md
	$(PY) benchmarks/bench_decode.py --threads 2 --dtype bf16 --batch 16 --skip nocache int8-cache int8-compiled int4-cache int4-compiled --out benchmarks/results/decode-bf16-batch16.md
	$(PY) benchmarks/bench_long.py --threads 2
	$(PY) benchmarks/profile_step.py --threads 2

# Issue 25's figures on the CPU at hand, one after another (about 50 minutes on 2 cores): run it
# on each CPU kind, an AVX2-only one above all. The files go to benchmarks/results/cpu-<kind>/.
bench-cpu: install
	$(PY) -m pip install -q -e '.[bench]'
	PY=$(PY) bash benchmarks/bench_cpu.sh

# On a machine with a GPU: training, bf16, flash attention, NCCL and decoding checked on CUDA, the
# figures in benchmarks/results/gpu-check.md (the suite runs the same script on the CPU).
gpu-check: install
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
