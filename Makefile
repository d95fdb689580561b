# specdec: `make run` (set up + one generation on the default model pair), `make test` (set up + tests).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PROTOS := $(wildcard protos/specdec/proto/*.proto)
GEN    := specdec/proto/.generated-stamp
# Torch first, pinned: this machine's local CPU wheel. A looser pin pulls GBs of CUDA packages.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup proto kernels run test test-fast settings-doc bench gpu-check clean prometheus eagle-head llama-cpp guidellm

setup: $(STAMP) $(GEN) kernels

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

proto: $(GEN)

# specdec's CPU kernels (specdec/engine/cpu_kernels.py: the skinny GEMM, row attention, the row ops, the decoder), compiled once with the
# host's C++ compiler and cached; prints why not where they cannot be (neither AVX-512 nor AVX2, no compiler), and the tiers
# then run without them.
kernels: $(STAMP)
	$(PY) -m specdec.engine.cpu_kernels

$(GEN): $(PROTOS) $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch $@

# One generation through target, draft and coordinator processes on loopback, with statistics.
run: setup
	$(PY) -m specdec.client.cli run-local --max-new-tokens $${MAX_NEW_TOKENS:-128}

# Everything (what CI runs), on TEST_WORKERS pytest-xdist workers (a file's tests stay on one: --dist loadfile;
# the suite mostly waits on processes and sockets, so two workers on two cores halve it); --durations shows
# where the time goes. TEST_WORKERS=0: one process, the files in name order.
TEST_WORKERS ?= 2
test: setup prometheus
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) --durations=20 tests

# The fast tier while changing code: the unit tests (no services, in this process or as processes, no real
# model pair, no long statistical, load or torch.compile tests; the marks are in pyproject.toml).
test-fast: setup
	$(PY) -m pytest -q -m "not processes and not real_pair and not slow and not servers" --durations=15 tests

# docs/settings.md from the config dataclasses (tests/test_settings.py fails while it is stale).
settings-doc: $(STAMP)
	$(PY) -m tests.settings_doc

# Debian's prometheus, which tests/test_prometheus.py runs against a local cluster: installed once
# (needs root and apt; a no-op when the binary is there).
prometheus:
	@command -v prometheus >/dev/null || { apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

# Benchmarks, each appending a section to the month's run log, docs/bench-logs/YYYY-MM.md (and redrawing
# docs/bench_*.png); docs/BENCHMARKS.md holds the current figures, each citing its section:
#  bench.run          target alone vs HF assisted generation vs specdec per proposer and K, on open,
#                     grounded and repeated-template workloads (~15 min quick;
#                     BENCH_ARGS=--long for the full matrix, BENCH_ARGS=--help for the options)
#  bench.concurrency  1/4/16/32 concurrent clients: specdec, specdec K=0, HF generate_batch and padded
#                     generate (~10 min; CONCURRENCY_ARGS=--help)
#  bench.self_draft   the target's own bfloat16 / float16 / int8 copies as drafts (~2 min), then the float16
#                     copy as the draft end to end (bench.run, separate cores, open workload, 128 tokens; ~2 min)
#  bench.draft_vocab  the draft's LM head over part of the vocabulary (--draft-vocab): its agreement with the
#                     target on held-out prompts and its step, per vocabulary (~2 min; DRAFT_VOCAB_ARGS=--help)
#  bench.replicas     1 vs 2 target replicas under the same load (~4 min; BENCH_REPLICAS_ARGS=--help)
#  bench.overhead     per-round gRPC + coordinator time on a tiny model, then on the default pair against its
#                     goal, <= 5% of a round outside the forwards (~2 min; OVERHEAD_ARGS, OVERHEAD_PAIR_ARGS=--help)
#  bench.step_cost    forward time against tokens scored and batch size per step mode, the memory-bandwidth
#                     floor, the K = 0 loop vs HF generate eager and compiled (~10 min; STEP_COST_ARGS=--help)
#  bench.exactness    argmax flips between forward shapes and step modes (~6 min; EXACTNESS_ARGS=--help)
#  bench.prefix_reuse TTFT of turn 2+ vs turn 1, multi-turn chat and agent calls, prefix cache on vs off
#                     (~8 min; PREFIX_REUSE_ARGS=--help; --quick: a tiny model, ~1.5 min)
#  bench.prefill_cost a prompt's prefill, every chain on row attention vs its chunks on PyTorch's attention
#                     (~1 min; PREFILL_COST_ARGS=--help)
#  bench.scoring      a prompt scored through the OpenAI API (echo + logprobs, as lm-eval sends it) vs the same
#                     request unscored vs transformers' forward, and the scores' difference from it (~2 min;
#                     SCORING_ARGS=--help)
#  bench.seeded       seeded sampled requests (the keyed race: a seed fixes the output) against unseeded ones
#                     (rejection sampling): tok/s at one client and in a burst, acceptance at a fixed K, one output
#                     per seed at K = 0 / K / the default, the target's draw cost (~5 min; SEEDED_ARGS=--help)
#  bench.structured   grammar engines' mask cost; JSON-schema extraction constrained vs unconstrained vs the
#                     target alone with the same grammar (~5 min; STRUCTURED_ARGS=--help)
#  bench.proposer_replay  prompt lookup and suffix decoding's chain limits and trees replayed on the
#                     target's greedy outputs: tokens per forward, exact and timing-free (~3 min; REPLAY_ARGS=--help)
#  bench.tree_replay  the draft model's token trees (chains, dynamic trees, the exhaustive best-first bound)
#                     replayed on the target's greedy answers: tokens per round (~5 min; TREE_REPLAY_ARGS=--help)
# The GPU path checked and measured in under 8 minutes on a GPU machine with the repository, the model pair and
# an environment with a CUDA torch (no network): the CUDA tests, greedy identity and argmax flips, the step
# cost, the workloads against the target alone, 1 and 32 clients (bench/gpu_check.py; GPU_CHECK_ARGS=--help,
# --cpu-smoke to try the plan on a CPU). Uses $(PY) as it is: no setup step, which would need the network.
gpu-check:
	$(PY) -m bench.gpu_check $(GPU_CHECK_ARGS)

bench: setup
	$(PY) -m bench.step_cost $(STEP_COST_ARGS)
	$(PY) -m bench.quant_formats $(QUANT_FORMATS_ARGS)
	$(PY) -m bench.exactness --dtypes float32 --tokens 64 --prompts 6 $(EXACTNESS_ARGS)
	$(PY) -m bench.overhead --own-rounds $(OVERHEAD_ARGS)
	$(PY) -m bench.overhead --pair --ks 0,2 --generations 6 $(OVERHEAD_PAIR_ARGS)
	$(PY) -m bench.run $(BENCH_ARGS)
	$(PY) -m bench.concurrency $(CONCURRENCY_ARGS)
	$(PY) -m bench.self_draft $(SELF_DRAFT_ARGS)
	$(PY) -m bench.draft_vocab $(DRAFT_VOCAB_ARGS)
	$(PY) -m bench.run --placements separate --workloads open --ks 3,4 --no-sampled --no-peer --proposers '' \
	    --draft "$$($(PY) -c 'from specdec.models import default_target; print(default_target())')" \
	    --draft-args '--dtype float16' --max-new-tokens 128
	$(PY) -m bench.replicas $(BENCH_REPLICAS_ARGS)
	$(PY) -m bench.prefix_reuse $(PREFIX_REUSE_ARGS)
	$(PY) -m bench.prefill_cost $(PREFILL_COST_ARGS)
	$(PY) -m bench.scoring $(SCORING_ARGS)
	$(PY) -m bench.seeded $(SEEDED_ARGS)
	$(PY) -m bench.structured $(STRUCTURED_ARGS)
	$(PY) -m bench.proposer_replay $(REPLAY_ARGS)
	$(PY) -m bench.tree_replay $(TREE_REPLAY_ARGS)
	$(PY) -m bench.head_cost $(HEAD_COST_ARGS)
	@# An EAGLE-3 head as the draft (EAGLE_HEAD=DIR, else the one `make eagle-head` wrote), where there is one
	@head="$${EAGLE_HEAD:-$$($(PY) -c 'from specdec.training.eagle3 import default_out; print(default_out())')}"; \
	if [ -f "$$head/config.json" ]; then \
	    $(PY) -m bench.eagle3_agreement --head "$$head" && \
	    $(PY) -m bench.run --draft "$$head" --no-peer --workloads open --placements separate --no-sampled \
	        --ks 1,2 --prompts 8 --max-new-tokens 64 --plot-dir "$$(mktemp -d)"; \
	else echo "make bench: no EAGLE-3 head at $$head (make eagle-head, or EAGLE_HEAD=DIR): the head's rows are not measured"; fi
	@# guidellm against the OpenAI API, where `make guidellm` installed it
	@if [ -x .venv-guidellm/bin/guidellm ]; then $(PY) -m bench.guidellm_sweep $(GUIDELLM_ARGS) && \
	    $(PY) -m bench.guidellm_sweep --data chat $(GUIDELLM_ARGS); \
	else echo "make bench: no .venv-guidellm (make guidellm): the guidellm sweep is not measured"; fi

# An EAGLE-3 draft head for the default target (or TARGET=...), trained on the CPU and written in the published
# layout (config.json + model.safetensors) to ~/.cache/specdec/eagle3/<target> (or EAGLE_OUT=...):
# specdec.training.eagle3, `EAGLE_ARGS=--help` for the options. The default pair on 2 cores: ~13 min of the
# target answering 632 prompts greedily and twice sampled (~220k tokens, on specdec's step with the features
# tapped as it goes), then EAGLE_MINUTES (30) of training: under an hour. `EAGLE_ARGS='--data FILE'` keeps the
# generated data (~1.4 GB) for later runs.
eagle-head: setup
	$(PY) -m specdec.training.eagle3 $${TARGET:+--target "$$TARGET"} $${EAGLE_OUT:+--out "$$EAGLE_OUT"} \
	    --minutes $${EAGLE_MINUTES:-30} $(EAGLE_ARGS)

# guidellm (the vLLM project's load generator) for bench.guidellm_sweep, in an environment of its own (its pandas,
# pyarrow and datasets stay out of specdec's), on the same torch pin: ~1.5 GB, so neither setup nor test does it.
guidellm:
	test -x .venv-guidellm/bin/python || $(PYTHON) -m venv .venv-guidellm
	.venv-guidellm/bin/python -m pip install -q "$(TORCH_PIN)" guidellm==0.8.1

# The llama.cpp peer of bench.run (the same GGUF and prompts through llama-cpp-python): a source build of
# llama.cpp with CMake, ~12 min on 2 shared cores, so neither setup nor bench does it. AVX2, and each AVX-512
# extension this CPU lists (/proc/cpuinfo), AMX off: a native build's AMX kernels die of SIGILL where the VM does
# not grant AMX (these machines); --no-cache-dir, so that pip cannot reuse a wheel built with other flags.
cpu_has = $(if $(shell grep -s -m1 -ow $(1) /proc/cpuinfo),-D$(2)=ON,-D$(2)=OFF)
LLAMA_CPP_CMAKE ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    $(call cpu_has,avx512f,GGML_AVX512) $(call cpu_has,avx512_vbmi,GGML_AVX512_VBMI) \
    $(call cpu_has,avx512_vnni,GGML_AVX512_VNNI) $(call cpu_has,avx512_bf16,GGML_AVX512_BF16) \
    $(call cpu_has,avx_vnni,GGML_AVX_VNNI) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF
llama-cpp: setup
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=2 \
	    $(PY) -m pip install --no-cache-dir llama-cpp-python==0.3.36 diskcache==5.6.3

clean:
	rm -rf $(VENV) .venv-guidellm specdec/proto/*_pb2*.py* $(GEN) *.egg-info
