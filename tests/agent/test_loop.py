"""The agent loop on the tiny Qwen2.5-VL, token-in/token-out:

- a two-tool-call trajectory worked by hand: masks, turn boundaries, the observation turns' ids (the
  chat template's tool turn with the image placeholders expanded by the processor), and the batch's
  response equal to what was generated plus what was appended (nothing re-tokenized);
- the response budget (model and tool tokens) and overlong observations cut with a marker;
- an environment's opening observation, per-turn rewards and its end; an opening observation with an
  image (an environment file whose ``reset`` returns ``[text, image]``) trains;
- through the transformers backend: rollout log-probs equal the trainer's on trajectories whose tool
  returned an image.
"""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _batches import policy_actor
from _models import training_model
from PIL import Image

from mmrl.agent.backend import trajectory_contexts
from mmrl.agent.environments import GuessTheNumber
from mmrl.agent.loop import AgentLoop, LoopOptions, ObservationRenderer, sample_rows
from mmrl.agent.metrics import trajectory_log, trajectory_metrics
from mmrl.agent.parsing import parse_hermes_tool_calls
from mmrl.agent.tools import (
    ERROR_OVERSIZED,
    ToolCall,
    ToolOutput,
    ToolRunner,
    VideoFrames,
    tool_from_function,
)
from mmrl.agent.trajectory import STOP_ANSWER, STOP_BUDGET, STOP_MAX_TURNS, assemble_trajectory_batch
from mmrl.columns import TrajectoryInputs, check_batch
from mmrl.data.collate import collate_prompts
from mmrl.data.config import DataConfig
from mmrl.data.dataset import PromptDataset
from mmrl.data.processing import MediaProcessor, attach_media, load_tokenizer_and_processor
from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS
from mmrl.logging.console import ConsoleLogger
from mmrl.models.loading import load_model
from mmrl.protocol import DataProto
from mmrl.workers.rollout import SamplingParams
from mmrl.workers.rollout.hf import HFRollout


def zoom(x: int, y: int, row: dict = None) -> Image.Image:
    """Crop a 28x28 region of the image.

    Args:
        x: left edge
        y: top edge
    """
    return row["images"][0].crop((x, y, x + 28, y + 28))


def describe(topic: str) -> str:
    """A long description."""
    return " ".join([topic] * 400)


def frames(count: int) -> VideoFrames:
    """Frames of a clip."""
    return VideoFrames(np.full((count, 28, 28, 3), 128, np.uint8), fps=2.0)


TOOLS = {f.__name__: tool_from_function(f) for f in (zoom, describe, frames)}


@pytest.fixture(scope="module")
def parts(tiny_vl_path):
    tokenizer, processor = load_tokenizer_and_processor(str(tiny_vl_path))
    media = MediaProcessor(tokenizer, processor, DataConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return tokenizer, processor, media, eos


@pytest.fixture(scope="module")
def prompts(parts, shapes_data_dir):
    tokenizer, processor, media, _ = parts
    config = DataConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    dataset = PromptDataset(str(shapes_data_dir / "train.jsonl"), tokenizer, processor, config)
    batch = collate_prompts([dataset[i] for i in range(2)], tokenizer.pad_token_id)
    return attach_media(batch, media, rollout_media=True)


def make_loop(parts, tools=TOOLS, parse=parse_hermes_tool_calls, environment=None, **options) -> AgentLoop:
    _, _, media, eos = parts
    runner = ToolRunner(tools, timeout_s=5) if environment is None else None
    return AgentLoop(
        ObservationRenderer(media, "<|im_end|>"), parse, LoopOptions(**options), [eos], runner, environment
    )


def scripted(tokenizer, eos, texts_per_row):
    """A generate function that answers each row's turns with the given texts (and records requests)."""
    seen = []

    def generate(requests):
        seen.append([(request.row, request.trajectory.length, request.max_tokens) for request in requests])
        out = []
        for request in requests:
            text = texts_per_row[request.row][request.trajectory.record.model_turns]
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
            out.append((ids, [-0.5] * len(ids)))
        return out

    return generate, seen


CALL = '<tool_call>{{"name": "zoom", "arguments": {{"x": {x}, "y": 0}}}}</tool_call>'


def test_two_tool_calls_by_hand(parts, prompts):
    tokenizer, processor, _, eos = parts
    texts = [[CALL.format(x=0), CALL.format(x=14), "red"]]
    generate, seen = scripted(tokenizer, eos, texts)
    rows = sample_rows(prompts[:1], parts[2])
    [trajectory] = make_loop(parts).run(rows, 400, generate)
    assert trajectory.record.stop == STOP_ANSWER and trajectory.record.model_turns == 3
    assert [call.name for call in trajectory.record.calls] == ["zoom", "zoom"]
    assert trajectory.record.calls[0].media == ("image 28x28",)  # as returned (the processor sees 56x56)
    model = [tokenizer(text, add_special_tokens=False)["input_ids"] + [eos] for text in texts[0]]
    observations = [turn.token_ids for turn in trajectory.turns if not turn.by_model]
    # the observation turn: the chat template's tool turn, the image placeholder expanded (56x56 -> 4)
    expected_text = (
        "\n<|im_start|>user\n<tool_response>\n<|vision_start|>" + "<|image_pad|>" * 4
        + "<|vision_end|>\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )  # fmt: skip
    assert tokenizer.decode(observations[0]) == expected_text
    crop = rows[0]["images"][0].crop((0, 0, 28, 28))
    own = processor(text=[ObservationRenderer(parts[2], "<|im_end|>").text("tool", [_image_output(crop)])],
                    images=[crop.resize((56, 56), Image.BICUBIC)], return_tensors="pt")  # fmt: skip
    assert observations[0] == own["input_ids"][0].tolist()
    # requests: each turn continues from the trajectory so far, with the budget left
    lengths = [len(model[0]), len(model[0]) + len(observations[0])]
    assert seen == [[(0, 0, 400)], [(0, lengths[0] + len(observations[0]), 400 - lengths[1])],
                    [(0, sum(map(len, model[:2])) + sum(map(len, observations)), 400 - sum(map(len, model[:2])) - sum(map(len, observations)))]]  # fmt: skip

    batch = assemble_trajectory_batch(prompts[:1], [trajectory], 400, tokenizer.pad_token_id)
    response = batch.batch["responses"][0]
    valid = batch.batch["attention_mask"][0, -400:].bool()
    # nothing re-tokenized: the response is exactly the ids generated plus the ids appended
    assert response[valid].tolist() == model[0] + observations[0] + model[1] + observations[1] + model[2]
    a, b, c, o1, o2 = len(model[0]), len(model[1]), len(model[2]), len(observations[0]), len(observations[1])
    expected_mask = [1] * a + [0] * o1 + [1] * b + [0] * o2 + [1] * c
    assert batch.batch["response_mask"][0][valid].tolist() == expected_mask
    expected_turns = [1] * a + [2] * o1 + [3] * b + [4] * o2 + [5] * c
    assert batch.batch["response_turns"][0][valid].tolist() == expected_turns
    types = batch.batch["mm_token_type_ids"][0, -400:][valid]
    assert types.tolist().count(1) == 8 and (types[batch.batch["response_mask"][0][valid].bool()] == 0).all()
    media = batch.non_tensor_batch["multi_modal_inputs"][0]
    assert isinstance(media, TrajectoryInputs) and [turn for turn, _ in media.segments] == [0, 2, 4]
    assert batch.non_tensor_batch["trajectory_media"][0].turns == (2, 4)
    assert check_batch(batch) == []
    # the next turn's context: the prompt and the trajectory, media joined
    context = trajectory_contexts(prompts[:1], [_request(0, trajectory)], tokenizer.pad_token_id)
    prompt_ids = prompts.batch["input_ids"][0][prompts.batch["attention_mask"][0].bool()].tolist()
    assert context.batch["input_ids"][0].tolist() == prompt_ids + trajectory.token_ids()
    assert len(context.non_tensor_batch["multi_modal_inputs"][0]["image_grid_thw"]) == 3


def _image_output(image):
    from mmrl.agent.tools import tool_output

    return tool_output(image)


def _request(row, trajectory):
    from mmrl.agent.backend import TurnRequest

    return TurnRequest(row, trajectory, 1)


def test_budget_max_turns_and_oversized_observations(parts, prompts):
    tokenizer, _, _, eos = parts
    rows = sample_rows(prompts[:1], parts[2]) * 3
    long_call = '<tool_call>{"name": "describe", "arguments": {"topic": "red"}}</tool_call>'
    texts = [[long_call, "red"], [CALL.format(x=0)] * 3, [CALL.format(x=0), "red"]]
    generate, _ = scripted(tokenizer, eos, texts)
    loop = make_loop(parts, max_turns=2, max_observation_tokens=64)
    call_tokens = len(tokenizer(CALL.format(x=0), add_special_tokens=False)["input_ids"]) + 1
    # a budget the call fits in, but not its observation: stopped, the observation not appended
    cut, turns_out = loop.run(rows[:2], 400, generate)
    [budget] = loop.run(rows[2:], call_tokens + 8, scripted(tokenizer, eos, texts[2:])[0])
    assert cut.record.stop == STOP_ANSWER and cut.record.calls[0].error == ERROR_OVERSIZED
    assert len(cut.turns[1].token_ids) <= 64 and "[... cut:" in tokenizer.decode(cut.turns[1].token_ids)
    assert turns_out.record.stop == STOP_MAX_TURNS and turns_out.record.model_turns == 2
    assert budget.record.stop == STOP_BUDGET and len(budget.turns) == 1
    metrics = trajectory_metrics([cut.record, turns_out.record, budget.record])
    assert metrics["agent/turns/mean"] == 5 / 3 and metrics["agent/tool_calls/mean"] == 1.0
    assert metrics["agent/tool_calls/zoom"] == 2 and metrics["agent/tool_calls/describe"] == 1
    assert metrics["agent/errors/oversized"] == 1 and metrics["agent/errors/timeout"] == 0
    assert [metrics[f"agent/stop/{stop}"] for stop in ("answer", "max_turns", "budget")] == [1 / 3] * 3
    assert (
        metrics["agent/observation_tokens/mean"]
        == sum(r.observation_tokens for r in (cut.record, turns_out.record)) / 3
    )


def test_video_frames_and_a_malformed_call_are_observations(parts, prompts):
    tokenizer, _, _, eos = parts
    texts = [
        [
            '<tool_call>{"name": "frames", "arguments": {"count": 3}}</tool_call>',
            "<tool_call>{oops</tool_call>",
            "red",
        ]
    ]
    generate, _ = scripted(tokenizer, eos, texts)
    [trajectory] = make_loop(parts).run(sample_rows(prompts[:1], parts[2]), 2000, generate)
    assert trajectory.record.stop == STOP_ANSWER
    video_turn, error_turn = trajectory.turns[1], trajectory.turns[3]
    assert "video_grid_thw" in video_turn.inputs and 2 in video_turn.token_types  # 3 frames padded to 4
    assert "Error (bad_call): the tool call is not valid JSON" in tokenizer.decode(error_turn.token_ids)
    # the generations log shows the calls, what they returned, and how the trajectory ended
    logged = trajectory_log(trajectory.record)
    assert logged["stop"] == "answer" and len(logged["turns"]) == 5
    assert [(c["name"], c["media"], c["error"]) for c in logged["calls"]] == [("frames", ["video 3 frames"], None), ("?", [], "bad_call")]  # fmt: skip
    stream = io.StringIO()
    ConsoleLogger(1, stream=stream).log_generations(
        [{"prompt": "p", "response": "r", "trajectory": logged}], 1
    )
    assert (
        "tools:    frames({'count': 3}) -> video 3 frames; ?(None) -> bad_call | ended by answer"
        in stream.getvalue()
    )
    assert [call.error for call in trajectory.record.calls] == [None, "bad_call"]
    # the compact form (trajectory_media) gives a worker the very same processor outputs
    remade, _ = parts[2].model_media(video_turn.media)
    assert remade.keys() == video_turn.inputs.keys()
    assert all(torch.equal(remade[key], video_turn.inputs[key]) for key in remade)


class ScriptedBackend:
    """A turn backend whose turns are :func:`scripted`'s (what the loop asks of a rollout backend)."""

    def __init__(self, generate, pad_token_id: int):
        self.generate, self.pad_token_id = generate, pad_token_id

    def turn_generator(self, prompts, sampling, chunks=None):
        return self.generate


def test_each_group_is_handed_out_as_soon_as_its_trajectories_have_ended(parts, prompts):
    """``generate_groups``: the first prompt's two trajectories answer at once, the second's call zoom
    first. The first group is handed out before the zoom calls run, the second after its second model
    turn, and together they are the batch ``generate`` makes of the same turns."""
    tokenizer, _, _, eos = parts
    texts = [["red"], ["blue"], [CALL.format(x=0), "red"], [CALL.format(x=14), "green"]]
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=400)
    generate, seen = scripted(tokenizer, eos, texts)
    handed, events = [], []

    def logged_zoom(x: int, y: int, row: dict = None) -> Image.Image:
        """Crop a 28x28 region of the image.

        Args:
            x: left edge
            y: top edge
        """
        events.append("zoom")
        return zoom(x, y, row=row)

    def hand_out(group):
        events.append("group")
        handed.append((len(seen), group))

    loop = make_loop(parts, tools={"zoom": tool_from_function(logged_zoom)})
    loop.generate_groups(ScriptedBackend(generate, tokenizer.pad_token_id), prompts, sampling, hand_out)
    assert events == ["group", "zoom", "zoom", "group"]
    assert [(turns_sampled, len(group)) for turns_sampled, group in handed] == [(1, 2), (2, 2)]
    for index, (_, group) in enumerate(handed):  # each group: one prompt's rows
        assert torch.equal(group.batch["prompts"], prompts.batch["input_ids"][[index, index]])
        assert [record.model_turns for record in group.non_tensor_batch["trajectory"]] == [index + 1] * 2
        assert check_batch(group) == []
    whole = make_loop(parts).generate(
        ScriptedBackend(scripted(tokenizer, eos, texts)[0], tokenizer.pad_token_id), prompts, sampling
    )
    joined = DataProto.concat([group for _, group in handed])
    assert set(joined.batch.keys()) == set(whole.batch.keys())
    for key in whole.batch.keys():
        assert torch.equal(joined.batch[key], whole.batch[key]), key
    assert [record.stop for record in joined.non_tensor_batch["trajectory"]] == [STOP_ANSWER] * 4


def _gated_zoom(events: list, gate):
    """A zoom whose call at ``x=0`` waits for ``gate`` (up to 10 s): a slow tool."""

    def zoom_tool(x: int, y: int, row: dict = None) -> Image.Image:
        """Crop a 28x28 region of the image.

        Args:
            x: left edge
            y: top edge
        """
        if x == 0:
            gate.wait(10)
        events.append(f"zoom {x}")
        return zoom(x, y, row=row)

    return {"zoom": tool_from_function(zoom_tool)}


@pytest.mark.parametrize("schedule", ["lockstep", "as_ready"])
def test_as_ready_samples_a_trajectory_s_next_turns_while_another_s_tool_still_runs(parts, prompts, schedule):
    """Row 0's first call is slow: it returns only once row 1 asks for its third turn. ``as_ready``:
    row 1 is sampled on (turns 2 and 3) while row 0's call runs, then row 0. ``lockstep``: every turn
    waits for the turn's slowest call, so row 0's runs into its timeout (3 s here) and the gate opens
    only after; each trajectory is the same either way save for that answer."""
    import threading

    tokenizer, _, _, eos = parts
    gate, events = threading.Event(), []
    texts = [[CALL.format(x=0), "red"], [CALL.format(x=14), CALL.format(x=28), "green"]]
    generate, seen = scripted(tokenizer, eos, texts)

    def gated(requests):
        if any(request.row == 1 and request.trajectory.record.model_turns == 2 for request in requests):
            gate.set()
        return generate(requests)

    loop = make_loop(parts, tools=_gated_zoom(events, gate), as_ready=schedule == "as_ready")
    loop.tools.timeout_s = 3.0  # as_ready: row 1's two turns and calls fit in it however loaded the machine
    trajectories = loop.run(sample_rows(prompts, parts[2]), 400, gated)
    rows = [[row for row, _, _ in call] for call in seen]
    slow = trajectories[0].record.calls[0]
    if schedule == "as_ready":
        assert rows == [[0, 1], [1], [1], [0]]
        assert events == ["zoom 14", "zoom 28", "zoom 0"] and slow.error is None
    else:
        assert rows == [[0, 1], [0, 1], [1]]
        assert slow.error == "timeout" and events[:2] == ["zoom 14", "zoom 28"]
    assert [record.stop for record in (t.record for t in trajectories)] == [STOP_ANSWER] * 2
    assert [t.record.model_turns for t in trajectories] == [2, 3]
    assert tokenizer.decode(trajectories[1].turns[-1].token_ids) == "green<|im_end|>"


def test_as_ready_samples_calls_that_end_together_in_one_batch(parts, prompts):
    """Once a trajectory is ready, the others' calls may join its batch for a quarter of the last model
    turn's time (``AS_READY_GRACE``; the first turn takes 2 s here, so 0.5 s): a call 0.05 s slower
    than the first goes with it, not in an engine call of its own."""
    import time as clock

    tokenizer, _, _, eos = parts
    generate, seen = scripted(tokenizer, eos, [[CALL.format(x=0), "red"], [CALL.format(x=14), "green"]])

    def slow_first_turn(requests):
        if not seen:
            clock.sleep(2.0)
        return generate(requests)

    def zoom_tool(x: int, y: int, row: dict = None) -> Image.Image:
        """Crop a 28x28 region of the image.

        Args:
            x: left edge
            y: top edge
        """
        clock.sleep(0.05 if x else 0.0)
        return zoom(x, y, row=row)

    loop = make_loop(parts, tools={"zoom": tool_from_function(zoom_tool)}, as_ready=True)
    loop.run(sample_rows(prompts, parts[2]), 400, slow_first_turn)
    assert [[row for row, _, _ in call] for call in seen] == [[0, 1], [0, 1]]


def test_as_ready_trajectories_equal_lockstep_s_when_the_turns_do_not_depend_on_the_batch(parts, prompts):
    """Calls of uneven latency split the as_ready turns into other batches than lockstep's; with turns
    that depend on their row only, the batch ``generate`` assembles is the same, tensor for tensor."""
    import time as clock

    tokenizer, _, _, eos = parts
    texts = [
        [CALL.format(x=0), CALL.format(x=0), "red"],
        ["blue"],
        [CALL.format(x=14), "red"],
        [CALL.format(x=28), "green"],
    ]

    def slow_zoom(x: int, y: int, row: dict = None) -> Image.Image:
        """Crop a 28x28 region of the image.

        Args:
            x: left edge
            y: top edge
        """
        clock.sleep(0.03 * x)  # 0.42 s, 0.84 s
        return zoom(x, y, row=row)

    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=400)
    batches, calls = [], []
    for as_ready in (False, True):
        generate, seen = scripted(tokenizer, eos, texts)
        loop = make_loop(parts, tools={"zoom": tool_from_function(slow_zoom)}, as_ready=as_ready)
        batches.append(loop.generate(ScriptedBackend(generate, tokenizer.pad_token_id), prompts, sampling))
        calls.append([[row for row, _, _ in call] for call in seen])
    assert calls[0] == [[0, 1, 2, 3], [0, 2, 3], [0]]
    assert calls[1] != calls[0] and sorted(row for call in calls[1] for row in call) == [
        0,
        0,
        0,
        1,
        2,
        2,
        3,
        3,
    ]
    lockstep, as_ready = batches
    for key in lockstep.batch.keys():
        assert torch.equal(lockstep.batch[key], as_ready.batch[key]), key
    records = [batch.non_tensor_batch["trajectory"] for batch in batches]
    assert [r.turn_texts for r in records[0]] == [r.turn_texts for r in records[1]]


def test_as_ready_steps_environments_as_they_answer(parts, prompts):
    """Environments too: the slow episode's first step returns once the fast one has taken two more
    turns; ``as_ready`` samples the fast one's turns meanwhile, with each step's reward in its place."""
    import threading

    tokenizer, _, _, eos = parts
    gate = threading.Event()

    class Gated:
        def reset(self, row):
            self.slow = row["slow"]
            return "Go."

        def step(self, action_text):
            if self.slow:
                gate.wait(4)
            return "Again.", 1.0 if action_text == "stop" else 0.0, action_text == "stop"

    rows = [dict(row, slow=index == 0) for index, row in enumerate(sample_rows(prompts, parts[2]))]
    generate, seen = scripted(tokenizer, eos, [["go", "stop"], ["go", "go", "stop"]])

    def gated(requests):
        if any(request.row == 1 and request.trajectory.record.model_turns == 2 for request in requests):
            gate.set()
        return generate(requests)

    trajectories = make_loop(parts, environment=Gated, as_ready=True).run(rows, 400, gated)
    assert [[row for row, _, _ in call] for call in seen] == [[0, 1], [1], [1], [0]]
    assert [t.turn_rewards for t in trajectories] == [[0.0, 1.0], [0.0, 0.0, 1.0]]
    assert [t.record.stop for t in trajectories] == [STOP_ANSWER] * 2


def test_environment_turns_and_rewards(parts, prompts):
    tokenizer, _, _, eos = parts
    rows = [dict(row, ground_truth="42") for row in sample_rows(prompts[:1], parts[2])]
    generate, _ = scripted(tokenizer, eos, [["50", "no idea", "42"]])
    [trajectory] = make_loop(parts, environment=GuessTheNumber).run(rows, 400, generate)
    assert trajectory.turns[0].index == 0 and not trajectory.turns[0].by_model  # the opening observation
    # it follows the prompt's assistant header: that (empty) turn is closed first
    opening = "<|im_end|>\n<|im_start|>user\nGuess my number between 0 and 100. Answer with one number."
    assert tokenizer.decode(trajectory.turns[0].token_ids) == opening + "<|im_end|>\n<|im_start|>assistant\n"
    assert trajectory.turn_rewards == [0.0, 0.0, 1.0] and trajectory.record.stop == STOP_ANSWER
    assert (
        "go lower" in tokenizer.decode(trajectory.turns[2].token_ids)
        and trajectory.turns[2].media is not None
    )
    assert [turn.index for turn in trajectory.turns] == [0, 1, 2, 3, 4, 5]


def test_hf_rollout_log_probs_match_the_trainer_on_trajectories_with_images(parts, prompts, tiny_vl_path):
    tokenizer, _, _, _ = parts
    # every model turn asks for a zoom (a random model writes no calls), so images arrive mid-trajectory
    # and a quarter of the vocabulary ends a turn, so that the random model's turns are short
    _, _, media, eos = parts
    ends = [eos, *range(0, len(tokenizer), 4)]
    loop = AgentLoop(ObservationRenderer(media, "<|im_end|>"), lambda text: [ToolCall("zoom", {"x": 0, "y": 0})],
                     LoopOptions(max_turns=3), ends, ToolRunner(TOOLS, timeout_s=5))  # fmt: skip
    rollout = HFRollout(load_model(str(tiny_vl_path)), tokenizer, return_log_probs=True)
    rollout.eos_token_ids = ends
    batch = loop.generate(rollout, prompts, SamplingParams(n=2, temperature=0.7, max_tokens=96, seed=3))
    records = batch.non_tensor_batch["trajectory"]
    assert sum(len(record.calls) for record in records) >= 4 and check_batch(batch) == []
    actor = policy_actor(training_model(tiny_vl_path))
    log_probs, _ = actor.compute_log_probs(batch, micro_batch_size=4, temperature=0.7)
    mask = batch.batch["response_mask"].bool()
    assert (batch.batch["response_turns"][mask] % 2 == 1).all()
    gap = (log_probs - batch.batch["rollout_log_probs"]).abs()[mask]
    assert gap.max() < 1e-5


def test_prompts_show_the_tool_schemas(parts, shapes_data_dir):
    tokenizer, processor, _, _ = parts
    config = DataConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    path = str(shapes_data_dir / "train.jsonl")
    schemas = [TOOLS["zoom"].schema]
    with_tools = PromptDataset(path, tokenizer, processor, config, tools=schemas)[0]
    plain = PromptDataset(path, tokenizer, processor, config)[0]
    text = tokenizer.decode(with_tools["raw_prompt_ids"])
    assert (
        '"name": "zoom"' in text
        and "<tools>" in text
        and "<tools>" not in tokenizer.decode(plain["raw_prompt_ids"])
    )


def test_a_tool_zooms_into_the_image_the_data_holds_not_the_one_scaled_to_the_budget(parts, tmp_path):
    """The agent demo's premise: a 1120-px image seen at a 56x56 budget, a tool that returns its centre.
    The tool must get the image at the data's resolution; a crop of the scaled image has lost the mark."""
    from mmrl.agent.tools import load_tools
    from mmrl.demo.synthetic import COLORS, draw_sample

    tokenizer, processor, _, eos = parts
    image, question, answer = draw_sample("small_mark", np.random.default_rng(3))
    image.save(tmp_path / "mark.png")
    (tmp_path / "rows.jsonl").write_text(
        json.dumps({"problem": question, "answer": answer, "images": ["mark.png"]}) + "\n"
    )
    config = DataConfig(min_pixels=3136, max_pixels=3136)
    dataset = PromptDataset(str(tmp_path / "rows.jsonl"), tokenizer, processor, config)
    prompts = attach_media(
        collate_prompts([dataset[0]], tokenizer.pad_token_id).repeat(2, interleave=True),
        dataset.media,
        rollout_media=True,
    )
    assert prompts.non_tensor_batch["multi_modal_data"][0]["images"][0].size == (
        56,
        56,
    )  # what the model sees
    rows = sample_rows(prompts, dataset.media)
    assert rows[0]["images"][0] is rows[1]["images"][0]  # the n responses of a prompt share one decode
    assert np.array_equal(np.asarray(rows[0]["images"][0]), np.asarray(image.convert("RGB")))  # 1120 px

    zoom_file = Path(__file__).resolve().parents[2] / "examples" / "tools" / "zoom_center.py"
    loop = AgentLoop(
        ObservationRenderer(dataset.media, "<|im_end|>"), parse_hermes_tool_calls, LoopOptions(max_turns=2),
        [eos], ToolRunner(load_tools([str(zoom_file)]), timeout_s=5),
    )  # fmt: skip
    generate, _ = scripted(tokenizer, eos, [['<tool_call>{"name": "zoom"}</tool_call>', answer]] * 2)
    trajectories = loop.run(rows, 96, generate)
    zoomed = load_tools([str(zoom_file)])["zoom"].function(row={"images": [image.convert("RGB")]})
    assert {tuple(rgb) for rgb in np.asarray(zoomed).reshape(-1, 3)} & {COLORS[answer]}  # the mark, enlarged
    expected, _, _ = loop.renderer.encode("tool", [ToolOutput(images=[zoomed])], "expected")
    for trajectory in trajectories:
        assert trajectory.record.stop == STOP_ANSWER
        assert torch.equal(trajectory.turns[1].inputs["pixel_values"], expected["pixel_values"])


def test_the_video_tool_demo_plays_the_row_s_clip_into_the_tool_turn(parts, tiny_vl_path, tmp_path):
    """examples/tiny_cpu_agent_video.yaml's data settings and tool on its task (clip_flashes): the
    row carries the clip, the tool's 12 frames become the tool turn's 24 video tokens, and the
    trajectory (call, clip, answer) fits the config's response budget."""

    from mmrl.agent.loop import build_agent_loop, tool_schemas
    from mmrl.config.loading import load_config
    from mmrl.demo.synthetic import generate_shapes_dataset

    repo = Path(__file__).resolve().parents[2]
    data = generate_shapes_dataset("clip_flashes", tmp_path / "clip-flashes", n_train=3, n_val=3, seed=0)
    cfg = load_config(
        [f"config={repo / 'examples' / 'tiny_cpu_agent_video.yaml'}", f"data.train_files={data / 'train.jsonl'}",
         f"data.val_files={data / 'val.jsonl'}", f"worker.rollout.multi_turn.tools=[{repo / 'examples/tools/play_clip.py'}]"],
        check_paths=False,
    )  # fmt: skip
    tokenizer, processor, _, eos = parts
    multi_turn = cfg.worker.rollout.multi_turn
    dataset = PromptDataset(
        cfg.data.train_files, tokenizer, processor, cfg.data, tools=tool_schemas(multi_turn)
    )
    items = [dataset[i] for i in range(3)]
    assert all(item["input_ids"].shape[-1] <= cfg.data.max_prompt_length for item in items)
    prompts = attach_media(collate_prompts(items, tokenizer.pad_token_id), dataset.media, rollout_media=True)
    loop = build_agent_loop(multi_turn, dataset.media, [eos], "qwen2_5_vl")
    texts = [['<tool_call>{"name": "play"}</tool_call>', str(item["ground_truth"])] for item in items]
    generate, _ = scripted(tokenizer, eos, texts)
    trajectories = loop.run(sample_rows(prompts, dataset.media), cfg.data.max_response_length, generate)
    for trajectory in trajectories:
        assert trajectory.record.stop == STOP_ANSWER and [turn.by_model for turn in trajectory.turns] == [
            True,
            False,
            True,
        ]
        tool_turn = trajectory.turns[1]
        assert tool_turn.inputs["video_grid_thw"].tolist() == [[6, 4, 4]]  # 12 frames of 56x56
        assert tool_turn.token_types.count(2) == 24 and trajectory.record.observation_tokens == len(
            tool_turn.token_ids
        )
        assert trajectory_log(trajectory.record)["calls"][0]["media"] == ["video 12 frames"]


class _BrokenEnvironment:
    """Opens fine, then fails on its first step."""

    def reset(self, row):
        return ""  # no opening observation

    def step(self, action_text):
        raise RuntimeError("simulator crashed")


def test_a_failing_environment_ends_its_episode_not_the_run(parts, prompts):
    tokenizer, _, _, eos = parts
    generate, _ = scripted(tokenizer, eos, [["left"]])
    [trajectory] = make_loop(parts, environment=_BrokenEnvironment).run(
        sample_rows(prompts[:1], parts[2]), 400, generate
    )
    assert [turn.index for turn in trajectory.turns] == [1] and trajectory.turn_rewards == [0.0]
    assert trajectory.record.stop == STOP_ANSWER
    assert (
        trajectory.record.calls[0].error == "raised"
        and "simulator crashed" in trajectory.record.calls[0].output
    )


OPENING_IMAGE_ENVIRONMENT = """
from PIL import Image


class LookFirst:
    def reset(self, row):
        return ["Look at this first.", Image.new("RGB", (56, 56), "red")]

    def step(self, action_text):
        return ["And at this.", Image.new("RGB", (84, 56), "blue")], 0.5, False
"""


def test_an_opening_observation_with_an_image_trains(parts, prompts, tiny_vl_path, tmp_path):
    """An environment file whose opening observation holds an image (the prompt has one too): the
    trajectories' rollout log-probs equal the trainer's (its media check once failed on such rows:
    "the prompt: 8 image placeholder tokens but features for 4")."""
    from mmrl.agent.environments import load_environment

    tokenizer, _, media, eos = parts
    (tmp_path / "look.py").write_text(OPENING_IMAGE_ENVIRONMENT)
    ends = [eos, *range(0, len(tokenizer), 4)]  # short turns of the random model
    loop = AgentLoop(ObservationRenderer(media, "<|im_end|>"), parse_hermes_tool_calls, LoopOptions(max_turns=2),
                     ends, environment=load_environment(f"{tmp_path / 'look.py'}:LookFirst"))  # fmt: skip
    rollout = HFRollout(load_model(str(tiny_vl_path)), tokenizer, return_log_probs=True)
    rollout.eos_token_ids = ends
    batch = loop.generate(rollout, prompts, SamplingParams(n=2, temperature=0.7, max_tokens=96, seed=3))
    assert check_batch(batch) == []
    for row in range(len(batch)):
        segments = batch.non_tensor_batch["multi_modal_inputs"][row].segments
        assert [turn for turn, _ in segments][:2] == [0, 0]  # the prompt's image, then the opening one
        assert batch.non_tensor_batch["trajectory_media"][row].turns[0] == 0
    assert any(len(record.calls) == 2 for record in batch.non_tensor_batch["trajectory"])  # images later too
    log_probs, _ = policy_actor(training_model(tiny_vl_path)).compute_log_probs(batch, 4, temperature=0.7)
    mask = batch.batch["response_mask"].bool()
    assert (log_probs - batch.batch["rollout_log_probs"]).abs()[mask].max() < 1e-5


# ---------------------------------------------------------------- every observation kind (transformers)


@pytest.fixture(scope="module")
def omni_prompts(tiny_omni_path, tmp_path_factory):
    """2 audio prompts (beeps) for the tiny Qwen2.5-Omni thinker, with their media attached."""
    from mmrl.demo.synthetic import generate_shapes_dataset

    data = generate_shapes_dataset(
        "audio_beeps", tmp_path_factory.mktemp("beeps"), n_train=2, n_val=1, seed=0
    )
    tokenizer, processor = load_tokenizer_and_processor(str(tiny_omni_path))
    config = DataConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    dataset = PromptDataset(str(data / "train.jsonl"), tokenizer, processor, config)
    batch = collate_prompts([dataset[i] for i in range(2)], tokenizer.pad_token_id)
    return attach_media(batch, dataset.media, rollout_media=True), dataset.media


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_5_omni"])
def test_every_observation_kind_at_turn_0_and_later_trains_on_transformers(
    family, parts, prompts, omni_prompts, tiny_vl_path, tiny_omni_path
):
    """Text, an image, video frames, a mixed list (and on Omni a sound, and a list with one) as the
    opening observation and as a later one (tests/_observations.py, an environment file): every
    trajectory goes on after its observation, the observation's media reach the batch at its turn,
    and the rollout log-probs equal the trainer's."""
    from _observations import (
        AUDIO_KINDS,
        VL_KINDS,
        check_observation_batch,
        observation_loop,
        observation_prompts,
    )

    if family == "qwen2_5_vl":
        path, (base, media), kinds = tiny_vl_path, (prompts, parts[2]), VL_KINDS
    else:
        path, (base, media), kinds = tiny_omni_path, omni_prompts, AUDIO_KINDS
    tokenizer = media.tokenizer
    ends = [tokenizer.convert_tokens_to_ids("<|im_end|>"), *range(0, len(tokenizer), 4)]  # short turns
    rollout = HFRollout(load_model(str(path)), tokenizer, return_log_probs=True)
    rollout.eos_token_ids = ends
    sampling = SamplingParams(n=1, temperature=0.7, max_tokens=160, seed=5)
    batch = observation_loop(media, ends).generate(rollout, observation_prompts(base, kinds), sampling)
    check_observation_batch(batch)
    log_probs, _ = policy_actor(training_model(path)).compute_log_probs(batch, 4, temperature=0.7)
    mask = batch.batch["response_mask"].bool()
    assert (log_probs - batch.batch["rollout_log_probs"]).abs()[mask].max() < 1e-5


def test_the_row_s_full_size_images_are_decoded_only_when_a_tool_reads_them(parts, prompts):
    """``row["images"]`` is decoded on first access, once per prompt for its n rows: a tool that never
    reads it causes no decoding (its length is known without one)."""
    tokenizer, _, media, eos = parts
    repeated = prompts.repeat(3, interleave=True)
    rows = sample_rows(repeated, media)
    images = [row["images"] for row in rows]
    assert images[0] is images[2] and images[3] is images[5] and images[0] is not images[3]
    assert [len(row_images) for row_images in images] == [1] * 6 and not any(i.decoded for i in images)
    call = '<tool_call>{"name": "describe", "arguments": {"topic": "red"}}</tool_call>'
    generate, _ = scripted(tokenizer, eos, [[call, "red"]] * 6)
    make_loop(parts, max_observation_tokens=2048).run(rows, 4000, generate)
    assert not any(row_images.decoded for row_images in images)  # describe never looked
    generate, _ = scripted(tokenizer, eos, [[CALL.format(x=0), "red"]] * 3 + [["red"]] * 3)
    trajectories = make_loop(parts).run(rows, 400, generate)  # zoom reads the first prompt's images
    assert [len(t.record.calls) for t in trajectories] == [1, 1, 1, 0, 0, 0]
    assert images[0].decoded and not images[3].decoded
    # one decoding for the prompt's rows, whose calls ran at once: the same image object
    assert rows[0]["images"][0] is rows[2]["images"][0]
    source = media.source_images(repeated.non_tensor_batch["prompt_media"][0])[0]
    assert np.array_equal(np.asarray(rows[1]["images"][0]), np.asarray(source))
    copied = copy.deepcopy(rows[1])["images"]  # a tool or environment may copy its row
    assert isinstance(copied, list) and np.array_equal(np.asarray(copied[0]), np.asarray(source))
