# Everything a fresh machine of this kind needs: `make demo` and `make test` set up the environment
# first when it is missing or out of date (scripts/setup_env.sh is idempotent and quick when current).
VENV ?= .venv
PY := $(VENV)/bin/python
ASSETS ?= assets
PYTEST_ARGS ?=
# pytest-xdist workers of `make test` (groups of tests that share a run or a machine-wide resource stay
# in one; tests/conftest.py); TEST_WORKERS=0 runs the suite in this process alone
TEST_WORKERS ?= 2

# the project's environment when it is built (torch is there), else the python on PATH (a GPU image's own
# environment: docs/gpu.md); GPU_PYTHON=python3 picks another
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python)

.PHONY: gpu-check install lock assets assets-video assets-audio assets-spatial demo demo-video demo-audio demo-spatial assets-judge demo-judge assets-agent demo-agent assets-agent-video demo-agent-video assets-recipes bench-recipes bench bench-scale test test-fast quality docs style clean

install:
	@bash scripts/setup_env.sh

# tiny random Qwen2.5-VL, the synthetic colour task, and the answer-format warm-up the demo starts from
# re-freeze every installed version after changing dependencies (then `make install` reproduces it)
lock: install
	@{ head -2 scripts/constraints-cpu.lock; $(VENV)/bin/python -m pip freeze --exclude-editable | grep -v '^mmrl'; } > scripts/constraints-cpu.lock.new
	@mv scripts/constraints-cpu.lock.new scripts/constraints-cpu.lock

assets: install
	@$(PY) -m mmrl.demo.tiny --kind qwen2_5_vl --size tiny --out $(ASSETS)/models/tiny-qwen2.5-vl
	@$(PY) -m mmrl.demo.synthetic --task color --out $(ASSETS)/data/shapes-color --n_train 512 --n_val 64
	@$(PY) -m mmrl.demo.warmup --model $(ASSETS)/models/tiny-qwen2.5-vl \
		--data $(ASSETS)/data/shapes-color/train.jsonl --out $(ASSETS)/models/tiny-qwen2.5-vl-warm

demo: assets
	$(PY) -m mmrl.trainer.main config=examples/tiny_cpu.yaml $(ARGS)

# "How many times does the light flash?" (12-frame videos) with the tiny Qwen2.5-VL
assets-video: install
	@$(PY) -m mmrl.demo.tiny --kind qwen2_5_vl --size tiny --out $(ASSETS)/models/tiny-qwen2.5-vl
	@$(PY) -m mmrl.demo.synthetic --task video_flashes --out $(ASSETS)/data/video-flashes --n_train 512 --n_val 64
	@$(PY) -m mmrl.demo.warmup --model $(ASSETS)/models/tiny-qwen2.5-vl \
		--data $(ASSETS)/data/video-flashes/train.jsonl --out $(ASSETS)/models/tiny-qwen2.5-vl-video-warm

demo-video: assets-video
	$(PY) -m mmrl.trainer.main config=examples/tiny_cpu_video.yaml $(ARGS)

# "How many beeps are there?" (1.5 s clips) with the tiny Qwen2.5-Omni thinker
assets-audio: install
	@$(PY) -m mmrl.demo.tiny --kind qwen2_5_omni --size tiny --out $(ASSETS)/models/tiny-qwen2.5-omni
	@$(PY) -m mmrl.demo.synthetic --task audio_beeps --out $(ASSETS)/data/audio-beeps --n_train 512 --n_val 64
	@$(PY) -m mmrl.demo.warmup --model $(ASSETS)/models/tiny-qwen2.5-omni \
		--data $(ASSETS)/data/audio-beeps/train.jsonl --out $(ASSETS)/models/tiny-qwen2.5-omni-audio-warm

demo-audio: assets-audio
	$(PY) -m mmrl.trainer.main config=examples/tiny_cpu_audio.yaml $(ARGS)

# "Is the <shape> on the left or the right?" with the tiny Qwen2.5-VL (examples/tiny_cpu_spatial.yaml).
# The warm-up also trains the colour task's true labels (--aux_data), which opens the tiny model's image
# path; the left/right answers stay uniform. bench-recipes compares plain GRPO and the small-model recipe
# (DAPO dynamic sampling that never gives up a step, clip-higher, adaptive top-k entropy control) over
# seeds, on this task and on a second one (assets-recipes), at a cosine and a constant learning rate.
assets-spatial: install
	@$(PY) -m mmrl.demo.tiny --kind qwen2_5_vl --size tiny --out $(ASSETS)/models/tiny-qwen2.5-vl
	@$(PY) -m mmrl.demo.synthetic --task color --out $(ASSETS)/data/shapes-color --n_train 512 --n_val 64
	@$(PY) -m mmrl.demo.synthetic --task spatial --out $(ASSETS)/data/shapes-spatial --n_train 512 --n_val 64
	@$(PY) -m mmrl.demo.warmup --model $(ASSETS)/models/tiny-qwen2.5-vl \
		--data $(ASSETS)/data/shapes-spatial/train.jsonl --out $(ASSETS)/models/tiny-qwen2.5-vl-spatial-warm \
		--aux_data $(ASSETS)/data/shapes-color/train.jsonl --steps 200

demo-spatial: assets-spatial
	$(PY) -m mmrl.trainer.main config=examples/tiny_cpu_spatial.yaml $(ARGS)

# A judge teaches (examples/tiny_cpu_judge.yaml): a tiny judge that sees the image answers whether a
# response names the shape's colour; served by vLLM's OpenAI-compatible server, its yes/no is the only reward.
# bench/judge_demo.py then prints the judge's held-out accuracy (served), the policy's curve and the judge's time.
# The judge: 800 supervised steps from the random tiny model (3-7 min; one torch thread, which a
# shared machine needs), the judge docs/benchmarks.md's numbers were measured with.
assets-judge: assets
	@OMP_NUM_THREADS=1 $(PY) -m mmrl.demo.judge --model $(ASSETS)/models/tiny-qwen2.5-vl \
		--data_dir $(ASSETS)/data/shapes-color --out $(ASSETS)/models/tiny-judge-colour --steps 800

demo-judge: assets-judge
	$(PY) -m mmrl.trainer.main config=examples/tiny_cpu_judge.yaml $(ARGS)

# A demo that needs the tool (examples/tiny_cpu_agent.yaml): "What colour is the small mark at the centre?" on
# 1120-px images seen at a 56x56 pixel budget, with a tool that returns the centre at full resolution. The
# warm-up teaches the call format (calls 80 % of the time, answers uniformly) and, on the side, the colour
# task's true labels (another task: the tiny random model's eyes; --aux_data, as for the spatial demo).
# `python bench/agent_demo.py` runs the job with and without the tool and prints accuracy, tool-call rate
# and seconds per step.
assets-agent: install
	@$(PY) -m mmrl.demo.tiny --kind qwen2_5_vl --size tiny --out $(ASSETS)/models/tiny-qwen2.5-vl
	@$(PY) -m mmrl.demo.synthetic --task small_mark --out $(ASSETS)/data/small-mark --n_train 512 --n_val 64
	@$(PY) -m mmrl.demo.synthetic --task color --out $(ASSETS)/data/shapes-color --n_train 512 --n_val 64
	@$(PY) -m mmrl.demo.warmup --model $(ASSETS)/models/tiny-qwen2.5-vl \
		--data $(ASSETS)/data/small-mark/train.jsonl --out $(ASSETS)/models/tiny-qwen2.5-vl-agent-warm \
		--tool_file examples/tools/zoom_center.py --call_rate 0.8 --steps 200 \
		--aux_data $(ASSETS)/data/shapes-color/train.jsonl

demo-agent: assets-agent
	$(PY) -m mmrl.trainer.main config=examples/tiny_cpu_agent.yaml $(ARGS)

# The smaller video-tool demo (examples/tiny_cpu_agent_video.yaml): "How many times does the light flash?"
# with a still in the prompt and a tool (examples/tools/play_clip.py) that returns the clip's frames. The
# warm-up teaches the call format only. `python bench/agent_demo.py --demo video` runs it with and without
# the tool.
assets-agent-video: install
	@$(PY) -m mmrl.demo.tiny --kind qwen2_5_vl --size tiny --out $(ASSETS)/models/tiny-qwen2.5-vl
	@$(PY) -m mmrl.demo.synthetic --task clip_flashes --out $(ASSETS)/data/clip-flashes --n_train 512 --n_val 64
	@$(PY) -m mmrl.demo.warmup --model $(ASSETS)/models/tiny-qwen2.5-vl \
		--data $(ASSETS)/data/clip-flashes/train.jsonl --out $(ASSETS)/models/tiny-qwen2.5-vl-agent-video-warm \
		--tool_file examples/tools/play_clip.py --call_rate 0.8 --steps 150 --max_response_length 112

demo-agent-video: assets-agent-video
	$(PY) -m mmrl.trainer.main config=examples/tiny_cpu_agent_video.yaml $(ARGS)

# seeds x {plain, dapo, entropy} on the spatial task; resumable (bench/results/recipes/), SEEDS x 3 runs
# The study's second task (bench/recipes.py): "Which shape is bigger, the red one or the blue one?", warmed
# up as the spatial task is (answers uniform, the colour task trained on the side).
assets-recipes: assets-spatial
	@$(PY) -m mmrl.demo.synthetic --task bigger --out $(ASSETS)/data/shapes-bigger --n_train 512 --n_val 64
	@$(PY) -m mmrl.demo.warmup --model $(ASSETS)/models/tiny-qwen2.5-vl \
		--data $(ASSETS)/data/shapes-bigger/train.jsonl --out $(ASSETS)/models/tiny-qwen2.5-vl-bigger-warm \
		--aux_data $(ASSETS)/data/shapes-color/train.jsonl --steps 200

bench-recipes: assets-recipes
	$(PY) bench/recipes.py $(ARGS)

# CPU benchmarks (docs/benchmarks.md): each prints its table and writes bench/results/*.json.
# Sized for < 20 min on a quiet 2-core machine; other jobs on it slow every step (tables say how much).
bench: assets
	$(PY) bench/vs_trl.py
	$(PY) bench/time_to_accuracy.py --model $(ASSETS)/models/tiny-qwen2.5-vl-warm \
		--data_dir $(ASSETS)/data/shapes-color
	$(PY) bench/cost_curves.py
	$(PY) bench/packing.py --repeats 3
	$(PY) bench/rollout_speed.py --repeats 2
	$(PY) bench/agent_turns.py
	$(PY) bench/sequence_parallel.py --lengths 1024 2048 4096 --repeats 1
	$(PY) bench/colocated_critic.py
	$(PY) bench/long_video.py --sides 56 112 --backends hf vllm
	@$(PY) bench/report.py

# On a GPU machine, in the environment of the GPU install (docs/gpu.md): the CUDA-only paths on one GPU (minutes),
# a table, exit 1 on any mismatch; no Ray or vLLM needed. ARGS="--dry" checks the script on a CPU.
gpu-check:
	$(GPU_PYTHON) bench/gpu_check.py $(ARGS)

# the real job's costs at Qwen2.5-VL-3B's widths and vocabulary (docs/benchmarks.md): ~1 h on this machine
bench-scale: install
	$(PY) bench/scale.py --run memory media startup smoke

# each of the suite's ~400 processes (drivers, ranks, reward workers) would compile mmrl's modules again where
# PYTHONDONTWRITEBYTECODE is set (as on these machines): the suite keeps their bytecode (docs/benchmarks.md)
KEEP_BYTECODE = PYTHONDONTWRITEBYTECODE=

test: install
	$(KEEP_BYTECODE) $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

test-fast: install
	$(KEEP_BYTECODE) $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not slow" -x -q $(PYTEST_ARGS)

# lint style and formatting, and the layer rules of DESIGN.md (contracts in pyproject.toml)
quality: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# the reference pages (docs/, mkdocs.yml) in strict mode: a broken link, a page missing from the nav or a
# nav entry without its page fails; the site goes to build/site (git-ignored)
docs: install
	$(VENV)/bin/mkdocs build --strict --site-dir build/site

style: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
	$(PY) scripts/example_config.py

clean:
	rm -rf $(ASSETS) outputs checkpoints .pytest_cache .ruff_cache .import_linter_cache .grimp_cache
