"""Multi-turn trajectories on a rollout worker of its own (``worker.rollout.placement=separate``),
driven in this process (mmrl/workers/rollout_worker.py: the agent built there, tools and their images
there; mmrl/workers/rollout/streaming.py: ``AgentStream``):

- a generation (sync, one step off, validation) returns the colocated multi-turn batch exactly: the
  agent columns, the tool's image in an observation turn, every token stamped with the worker's version;
- streaming: a weight push lands while a tool call is in flight; the call completes, the next model turn
  is sampled by the new weights (its tokens carry version 1, the first turn's 0), and the trajectories
  equal a colocated reference whose tool switches the weights at that moment.

The tiny random model writes no tool calls: every model turn is read as a call of ``zoom`` and a
quarter of the vocabulary ends a turn (as tests/agent/test_loop.py does), so that turns are short and
images arrive mid-trajectory.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from _models import PushBefore

from mmrl.agent.loop import tool_schemas
from mmrl.agent.tools import ToolCall, ToolRunner, tool_from_function
from mmrl.columns import check_batch
from mmrl.config.loading import load_config
from mmrl.data.collate import collate_prompts
from mmrl.data.dataset import PromptDataset
from mmrl.data.processing import attach_media, load_tokenizer_and_processor
from mmrl.protocol import DataProto
from mmrl.workers.rollout import GenerationMode
from mmrl.workers.rollout.engine import build_agent, build_rollout_engine, generate_with, sampling_params

REPO_ROOT = Path(__file__).resolve().parents[3]
ZOOM_FILE = REPO_ROOT / "examples/tools/zoom.py"
CALL = ToolCall("zoom", {"x": 0.0, "y": 0.0, "size": 0.5})


@pytest.fixture(scope="module")
def config(tiny_vl_path, shapes_data_dir):
    return load_config(
        [
            f"data.train_files={shapes_data_dir / 'train.jsonl'}",
            "data.max_prompt_length=640",  # the tool's schema in the system prompt
            "data.max_response_length=96",
            "data.min_pixels=3136",
            "data.max_pixels=12544",
            f"worker.actor.model.model_path={tiny_vl_path}",
            "worker.rollout.name=hf",
            "worker.rollout.n=2",
            "worker.rollout.temperature=0.7",
            "worker.rollout.placement=separate",
            "worker.rollout.stream_chunk_tokens=2",
            "worker.rollout.multi_turn.enable=true",
            f"worker.rollout.multi_turn.tools=[{ZOOM_FILE}]",
            "worker.rollout.multi_turn.max_turns=2",
            "trainer.async_mode=stream",
            "trainer.n_gpus_per_node=1",
            "trainer.device=cpu",
            f"worker.reward.reward_function={REPO_ROOT / 'tests/trainer/assets/fingerprint_reward.py'}:compute_score",
        ]
    )


@pytest.fixture(scope="module")
def prompts(config, tiny_vl_path):
    """Two prompts as the driver sends them (compact media refs), the tool's schema shown."""
    tokenizer, processor = load_tokenizer_and_processor(str(tiny_vl_path))
    schemas = tool_schemas(config.worker.rollout.multi_turn)
    dataset = PromptDataset(config.data.train_files, tokenizer, processor, config.data, tools=schemas)
    return collate_prompts([dataset[0], dataset[1]], tokenizer.pad_token_id)


def calls_every_turn(engine, agent) -> None:
    """Every model turn is a call of zoom; a quarter of the vocabulary (and EOS) ends a turn."""
    ends = [*engine.eos_token_ids, *range(0, len(engine.tokenizer), 4)]
    engine.eos_token_ids = ends
    agent.end_of_turn_ids = set(ends)
    agent.parse = lambda text: [CALL]


@pytest.fixture(scope="module")
def worker(config):
    """A RolloutWorker in this process (a process group of one, on loopback)."""
    from mmrl.workers.rollout_worker import RolloutWorker

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    saved = {key: os.environ.get(key) for key in [*env, "OMP_NUM_THREADS"]}  # setup_distributed sets it
    os.environ.update(env)
    try:
        # this session's threads, unchanged
        worker = RolloutWorker(config, cpu_threads=torch.get_num_threads())
        calls_every_turn(worker.engine, worker.agent)
        yield worker
        worker.shutdown()
    finally:  # also when the worker failed to start: later tests in this process see none of it
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value


def colocated(config, switch_weights=None):
    """What a training rank with the engine colocated builds: the engine and the agent loop (the tool
    calling ``switch_weights`` on its first call when given)."""
    engine, model_type = build_rollout_engine(
        config, config.worker.actor.model.model_path, torch.device("cpu")
    )
    from mmrl.workers.fsdp_workers import build_media_processor

    media = build_media_processor(config)
    agent = build_agent(config, media, engine.eos_token_ids, model_type)
    calls_every_turn(engine, agent)
    if switch_weights is not None:
        agent.tools = ToolRunner({"zoom": tool_from_function(switching_zoom(agent, switch_weights))}, 20)
    return engine, agent, media


def switching_zoom(agent, on_first_call):
    """The tool file's zoom, calling ``on_first_call()`` on the first call before it returns."""
    zoom, first = agent.tools.tools["zoom"].function, threading.Lock()

    def zoom_then(x: float, y: float, size: float = 0.25, row: dict = None) -> list:
        """Look closer at a square region of the image.

        Args:
            x: left edge
            y: top edge
            size: side
        """
        if first.acquire(blocking=False):
            on_first_call()
        return zoom(x, y, size, row=row)

    return zoom_then


def updated_weights(tiny_vl_path) -> dict[str, torch.Tensor]:
    from mmrl.models.loading import load_model

    model = load_model(str(tiny_vl_path))
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.5 * torch.randn_like(parameter))
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def assert_same_trajectories(batch: DataProto, reference: DataProto) -> None:
    for key in (
        "responses",
        "response_mask",
        "response_turns",
        "input_ids",
        "attention_mask",
        "position_ids",
    ):
        assert torch.equal(batch.batch[key], reference.batch[key]), key
    assert torch.allclose(batch.batch["rollout_log_probs"], reference.batch["rollout_log_probs"], atol=1e-6)


def test_a_generation_returns_the_colocated_multi_turn_batch_with_the_tool_s_images(worker, config, prompts):
    worker.version = 2  # as after two pushes: every token is stamped with it
    try:
        batch = worker.generate(prompts, mode=GenerationMode.TRAIN, global_step=3)
    finally:
        worker.version = 0
    engine, agent, media = colocated(config)
    sampling = sampling_params(config, GenerationMode.TRAIN, 3, 0, 1)
    reference = generate_with(
        engine, agent, attach_media(prompts, media, rollout_media=True), sampling, GenerationMode.TRAIN,
        engine.model, 2,
    )  # fmt: skip
    assert_same_trajectories(batch, reference)
    assert check_batch(batch) == [] and "multi_modal_inputs" not in batch.non_tensor_batch  # refs only
    assert (batch.batch["policy_version"] == 2).all()
    records = batch.non_tensor_batch["trajectory"]
    assert all(record.calls and record.calls[0].media for record in records)  # each saw a zoom's image
    image_pad = engine.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for row, media in enumerate(batch.non_tensor_batch["trajectory_media"]):
        assert media is not None and media.turns[0] == 2  # the observation after the first model turn
        observation = batch.batch["responses"][row][batch.batch["response_turns"][row] == 2]
        assert (observation == image_pad).sum() > 0


def test_a_push_during_a_tool_call_reaches_the_next_turn_and_the_call_completes(
    worker, config, prompts, tiny_vl_path
):
    new_weights = updated_weights(tiny_vl_path)
    in_tool, pushed = threading.Event(), threading.Event()

    def wait_for_the_push():  # the first tool call is in flight until the push has landed
        in_tool.set()
        assert pushed.wait(60)

    original_tools = worker.agent.tools
    worker.agent.tools = ToolRunner(
        {"zoom": tool_from_function(switching_zoom(worker.agent, wait_for_the_push))}, 90
    )
    try:
        worker.stream_submit(prompts, submission=1)
        assert in_tool.wait(120)
        with worker.streaming.hold():  # receive_weights, its push group aside
            worker.engine.update_weights(new_weights.items())
            worker.version = 1
            worker.streaming.reload(1)
        pushed.set()
        parts = []
        while sum(len(part) for part in parts) < len(prompts) * 2:
            part = worker.stream_take(timeout_s=120)
            assert part is not None
            parts.append(part)
    finally:
        worker.agent.tools, worker.version = original_tools, 0
    streamed = DataProto.concat(parts)

    engine, agent, media = colocated(
        config, switch_weights=lambda: engine.update_weights(new_weights.items())
    )
    sampling = sampling_params(config, GenerationMode.TRAIN, 1, 0, 1)
    reference = generate_with(
        engine, agent, attach_media(prompts, media, rollout_media=True), sampling, GenerationMode.TRAIN,
        engine.model, None,
    )  # fmt: skip
    assert_same_trajectories(streamed, reference)
    assert all(record.calls[0].error is None for record in streamed.non_tensor_batch["trajectory"])
    turns, versions = streamed.batch["response_turns"], streamed.batch["policy_version"]
    model = streamed.batch["response_mask"].bool()
    assert (versions[model & (turns == 1)] == 0).all() and (versions[model & (turns == 3)] == 1).all()
    assert (model & (turns == 3)).any()  # a second model turn was sampled after the push

    unswitched_engine, unswitched_agent, _ = colocated(config)
    unswitched = generate_with(
        unswitched_engine, unswitched_agent, attach_media(prompts, media, rollout_media=True), sampling,
        GenerationMode.TRAIN, unswitched_engine.model, None,
    )  # fmt: skip
    assert not torch.equal(unswitched.batch["responses"], streamed.batch["responses"])  # the push mattered


def test_a_group_leaves_as_soon_as_its_trajectories_end_while_the_others_go_on(worker, prompts):
    """Streaming, an environment: the first prompt's episodes end at their first step, the second's
    block in their second until the test has taken a group. The first prompt's group arrives alone
    while the others are still stepping; theirs arrives once they are let go."""
    paced = prompts[[0, 1]]
    paced.non_tensor_batch["pace"] = np.array(["fast", "slow"], dtype=object)
    blocked, release = threading.Event(), threading.Event()

    class Paced:
        def reset(self, row):
            self.pace, self.steps = row["pace"], 0
            return "Begin."

        def step(self, action_text):
            self.steps += 1
            if self.pace == "slow" and self.steps == 2:
                blocked.set()
                release.wait(25)  # within the loop's 30 s step timeout
            return "Go on.", 0.0, self.pace == "fast" or self.steps == 2

    original = worker.agent.tools, worker.agent.environment
    worker.agent.tools, worker.agent.environment = None, Paced
    try:
        worker.stream_submit(paced, submission=2)
        first = worker.stream_take(timeout_s=60)
        assert first is not None and list(first.non_tensor_batch["pace"]) == ["fast", "fast"]
        assert blocked.wait(60) and worker.stream_take(timeout_s=0.5) is None  # the others still step
        release.set()
        rest = worker.stream_take(timeout_s=60)
    finally:
        release.set()
        worker.agent.tools, worker.agent.environment = original
    assert rest is not None and list(rest.non_tensor_batch["pace"]) == ["slow", "slow"]
    for part, turns in ((first, 1), (rest, 2)):
        assert [record.model_turns for record in part.non_tensor_batch["trajectory"]] == [turns] * 2
        assert check_batch(part) == []


@torch.no_grad()
def full_forward_turn(engine, models, switch_at, contexts, sampling):
    """The reference: each token drawn from a forward of the whole context so far (no cache), by
    ``models[0]`` before token ``switch_at`` and ``models[1]`` from it on, with the engine's draw."""
    from mmrl.models.inputs import build_forward_inputs

    input_ids, mask = contexts.batch["input_ids"], contexts.batch["attention_mask"]
    media = list(contexts.non_tensor_batch["multi_modal_inputs"])
    generator, tokens = torch.Generator().manual_seed(sampling.seed), []
    for step in range(sampling.max_tokens):
        model = models[0] if step < switch_at else models[1]
        logits = model(**build_forward_inputs(model, input_ids, mask, media)).logits[:, -1]
        token, _ = engine._sample(logits, sampling, generator)
        tokens.append(token)
        input_ids = torch.cat([input_ids, token.unsqueeze(-1)], dim=-1)
        mask = torch.cat([mask, mask.new_ones(len(token), 1)], dim=-1)
    return torch.stack(tokens, dim=1)


def test_a_push_in_the_middle_of_a_model_turn_continues_it_with_the_new_weights(config, tiny_vl_path):
    # 2-token chunks, the push before the third: tokens 0-3 by the old weights, 4-7 by the new ones after
    # that prefix (the turn's context, image included, encoded again), from one random stream
    from mmrl.agent.backend import TurnRequest, trajectory_contexts
    from mmrl.agent.trajectory import Trajectory
    from mmrl.models.loading import load_model
    from mmrl.workers.fsdp_workers import build_media_processor
    from mmrl.workers.rollout import SamplingParams
    from mmrl.workers.rollout.hf import HFRollout

    weights = updated_weights(tiny_vl_path)
    media = build_media_processor(config)
    dataset = PromptDataset(config.data.train_files, media.tokenizer, media.processor, config.data)
    prompts = collate_prompts([dataset[0], dataset[1]], media.tokenizer.pad_token_id)  # no schema: short
    rows = attach_media(prompts, media, rollout_media=True)
    old_model, new_model = load_model(str(tiny_vl_path)), load_model(str(tiny_vl_path))
    new_model.load_state_dict(weights)
    engine = HFRollout(load_model(str(tiny_vl_path)), media.tokenizer, return_log_probs=True, prepack=False)
    sampling = SamplingParams(n=1, temperature=1.0, max_tokens=8, seed=11, ignore_eos=True)
    chunks = PushBefore(lambda: engine.update_weights(weights.items()), tokens=2, at=3)  # prefill = 0
    requests = [TurnRequest(row, Trajectory(), 8) for row in range(len(rows))]
    turns = engine.turn_generator(rows, sampling, chunks=chunks)(requests)
    contexts = trajectory_contexts(rows, requests, engine.pad_token_id)
    expected = full_forward_turn(engine, [old_model, new_model], 4, contexts, sampling)
    assert [turn.token_ids for turn in turns] == expected.tolist()
    assert all(turn.versions == [0] * 4 + [1] * 4 for turn in turns)
    unchanged = full_forward_turn(engine, [old_model, old_model], 4, contexts, sampling)
    assert not torch.equal(unchanged[:, 4:], expected[:, 4:])  # the push mattered
