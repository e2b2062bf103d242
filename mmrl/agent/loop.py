"""The agent loop, token-in/token-out: generate a model turn → parse its tool calls → run them → append
the tool turn as token ids → generate again, until a final answer, ``max_turns`` or the response budget.

The loop never holds a model: :meth:`AgentLoop.generate` drives a rollout backend through its
turn-level interface (:class:`~mmrl.agent.backend.TurnBackend`), which samples one model turn for each
of a list of trajectories, continuing from the prompt and the trajectory's ids (and media) so far, and
returns the sampled ids with their log-probs. The loop keeps those ids as they are; the tool or
environment turn is the chat template's text for the new messages only (everything after the model's
end-of-turn token, up to and including the next assistant header), run through the model's processor
with its media, so image/video/audio placeholders are expanded as in a prompt. Decoded text is used to
*read* a model turn (tool calls, an environment's action), never to rebuild its ids.

The response budget (``max_response_length``) counts model and observation tokens: a model turn gets
the budget left, an observation longer than ``max_observation_tokens`` has its text cut (with a
marker) or, when its media alone are too long, is replaced by an error text, and an observation that
would leave no room for the next model turn ends the trajectory (``budget``).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mmrl.agent.backend import DecodeChunks, GenerateTurns, SampledTurn, TurnBackend, TurnRequest
from mmrl.agent.tools import (
    ERROR_BAD_RETURN,
    ERROR_OVERSIZED,
    ERROR_RAISED,
    ERROR_TIMEOUT,
    TIMED_OUT,
    BoundedRunner,
    ToolCall,
    ToolOutput,
    ToolRunner,
    error_output,
    run_bounded,
    tool_output,
)
from mmrl.agent.trajectory import (
    STOP_ANSWER,
    STOP_BUDGET,
    STOP_MAX_TURNS,
    ToolCallRecord,
    Trajectory,
    Turn,
    assemble_trajectory_batch,
)
from mmrl.config import MultiTurnConfig
from mmrl.data.processing import TOKEN_COLUMNS, MediaProcessor, PromptMedia, source_images
from mmrl.protocol import DataProto
from mmrl.sampling import SamplingParams

CUT_MARKER = " [... cut: {count} more tokens]"
LOGGED_OUTPUT_CHARS = 300  # of each tool output, in the trajectory record
# as_ready: once a trajectory is ready, how long the others' calls may still come back to join its
# batch, as a share of the last model turn's seconds: calls that end together are sampled together
AS_READY_GRACE = 0.25


class Environment(Protocol):
    """A task that is not function calls (a game, a GUI simulator, a simulated user). Observations are
    what a tool may return (text, PIL images, :class:`~mmrl.agent.tools.VideoFrames`,
    :class:`~mmrl.agent.tools.Audio`, or a list of them); None or "" for no observation."""

    def reset(self, row: dict[str, Any]) -> Any:
        """Start an episode for the sample ``row``; the opening observation (turn 0)."""

    def step(self, action_text: str) -> tuple[Any, float, bool]:
        """The model's turn as text → (observation, reward of this turn, whether the episode ended)."""


@dataclass(frozen=True)
class LoopOptions:
    """The ``worker.rollout.multi_turn`` settings the loop uses (plain values, see mmrl.config)."""

    max_turns: int = 4  # model turns per trajectory
    max_observation_tokens: int = 1024  # of one tool/environment turn; longer ones are cut
    timeout_s: float = 30.0  # of one tool call or environment step
    max_concurrency: int = 8  # tool calls (environment steps) running at once
    as_ready: bool = False  # a trajectory's next turn is sampled as soon as its own calls returned


class ObservationRenderer:
    """Renders tool and environment turns with the model's chat template and processor, as token ids.

    The turn's text is found by rendering a short conversation with and without the new messages: the
    text after the model's end-of-turn token is what the template puts between the model's turn and
    the next one (for Qwen: ``\\n<|im_start|>user\\n<tool_response>\\n...<|im_start|>assistant\\n``)."""

    def __init__(self, media: MediaProcessor, end_of_turn_token: str):
        self.media = media
        self.chat = media.processor if media.processor is not None else media.tokenizer
        base = self._base_messages()
        rendered = self.chat.apply_chat_template(base, tokenize=False)
        if end_of_turn_token not in rendered:
            raise ValueError(
                f"the chat template does not end an assistant turn with '{end_of_turn_token}' (the model's "
                "EOS): multi-turn rollouts need it to join turns (data.override_chat_template)"
            )
        self.prefix = rendered[: rendered.rindex(end_of_turn_token) + len(end_of_turn_token)]

    @staticmethod
    def _base_messages() -> list[dict[str, Any]]:
        return [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]

    @staticmethod
    def content(output: ToolOutput) -> list[dict[str, Any]]:
        kinds = [{"type": kind} for kind in output.order]
        return [*kinds, {"type": "text", "text": output.text}]

    def text(self, role: str, outputs: Sequence[ToolOutput], opening: bool = False) -> str:
        """The template's text for one message of ``role`` per output after the model's turn, through
        the next assistant header. ``opening``: an environment's first observation, which follows the
        prompt's assistant header: the text closes that (empty) assistant turn first."""
        new = [{"role": role, "content": self.content(output)} for output in outputs]
        if opening:
            base = self._base_messages()[:1]
            prefix = self.chat.apply_chat_template(base, add_generation_prompt=True, tokenize=False)
            base = [*base, {"role": "assistant", "content": ""}]
        else:
            base, prefix = self._base_messages(), self.prefix
        rendered = self.chat.apply_chat_template([*base, *new], add_generation_prompt=True, tokenize=False)
        if not rendered.startswith(prefix):
            raise ValueError("the chat template renders earlier turns differently once a tool turn follows")
        return rendered[len(prefix) :]

    def encode(
        self, role: str, outputs: Sequence[ToolOutput], where: str, opening: bool = False
    ) -> tuple[dict[str, Any], PromptMedia | None, dict[str, list[Any]]]:
        """The processor's outputs for the turn (``input_ids`` [1, T] and, with media, their tensors),
        the turn's media in compact form (None without media) and decoded (an engine's form)."""
        media = PromptMedia(
            prompt=self.text(role, outputs, opening),
            images=tuple(image for output in outputs for image in output.images),
            videos=tuple({"frames": v.array(), "fps": v.fps} for output in outputs for v in output.videos),
            audios=tuple(
                {"array": a.waveform, "sampling_rate": a.sampling_rate}
                for output in outputs
                for a in output.audios
            ),
            order=tuple(kind for output in outputs for kind in output.order),
            where=where,
        )
        encoded, decoded = self.media.encode(media)
        return encoded, media if media.order else None, decoded

    def text_tokens(self, text: str) -> list[int]:
        return self.media.tokenizer(text, add_special_tokens=False)["input_ids"]


class AgentLoop:
    """Runs the trajectories of one batch (see the module docstring). ``tools`` or ``environment`` (a
    factory of one :class:`Environment` per trajectory) says what answers the model."""

    def __init__(
        self,
        renderer: ObservationRenderer,
        parse: Callable[[str], list[ToolCall]],
        options: LoopOptions,
        end_of_turn_ids: Sequence[int],
        tools: ToolRunner | None = None,
        environment: Callable[[], Environment] | None = None,
    ):
        if (tools is None) == (environment is None):
            raise ValueError(
                "an agent loop answers the model with tools or with an environment (one of them)"
            )
        self.renderer = renderer
        self.parse = parse
        self.options = options
        self.tools = tools
        self.environment = environment
        self.tokenizer = renderer.media.tokenizer
        self.end_of_turn_ids = set(end_of_turn_ids)  # the model's EOS ids: a turn ending in one is complete

    # ---- observations ---------------------------------------------------------------------------

    def _cut_text(self, output: ToolOutput, keep: int) -> ToolOutput:
        """``output`` with its text cut to ``keep`` tokens, the marker included; flagged oversized."""
        ids = self.renderer.text_tokens(output.text)
        if len(ids) <= keep:
            return output
        marker = CUT_MARKER.format(count=len(ids))
        room = keep - len(self.renderer.text_tokens(marker))
        text = self.tokenizer.decode(ids[:room]) + marker if room > 0 else ""
        return ToolOutput(
            text, output.images, output.videos, output.audios, output.error or ERROR_OVERSIZED, output.seconds
        )

    def _observation(
        self, index: int, role: str, outputs: list[ToolOutput], where: str
    ) -> tuple[Turn, list[ToolOutput]]:
        """The observation turn of ``outputs``, cut to ``max_observation_tokens``: the texts are cut
        (the template's own tokens stay); when the media alone are too long the model is told instead.
        Returns the turn and the outputs as shown."""
        limit = self.options.max_observation_tokens
        encoded, media, decoded = self.renderer.encode(role, outputs, where, opening=index == 0)
        for attempt in range(3):  # text tokens counted alone may merge differently in the turn: recount
            length = encoded["input_ids"].shape[-1]
            if length <= limit:
                break
            texts = [len(self.renderer.text_tokens(output.text)) for output in outputs]
            room = sum(texts) - (length - limit)
            if room < 0 and attempt == 0 and any(output.order for output in outputs):
                message = (
                    f"the result had {length} tokens, over the limit of {limit} (max_observation_tokens)"
                )
                outputs = [error_output(ERROR_OVERSIZED, message, output.seconds) for output in outputs]
            else:
                shares = [count * max(0, room) // max(1, sum(texts)) if attempt < 2 else 0 for count in texts]
                outputs = [self._cut_text(output, share) for output, share in zip(outputs, shares)]
            encoded, media, decoded = self.renderer.encode(role, outputs, where, opening=index == 0)
        types = encoded.get("mm_token_type_ids")
        turn = Turn(
            index,
            encoded["input_ids"][0].tolist(),
            False,
            token_types=None if types is None else types[0].tolist(),
            media=media,
            inputs={key: value for key, value in encoded.items() if key not in TOKEN_COLUMNS}
            if media
            else {},
            engine_media=decoded if media else {},
        )
        return turn, outputs

    def _append_observation(
        self, trajectory: Trajectory, role: str, outputs: list[ToolOutput], budget: int, where: str
    ) -> tuple[bool, list[ToolOutput]]:
        """Append the observation unless it leaves no room for a model turn (then: stop, budget)."""
        turn, outputs = self._observation(trajectory.next_turn, role, outputs, where)
        if trajectory.length + len(turn.token_ids) >= budget:
            trajectory.record.stop = STOP_BUDGET
            return False, outputs
        trajectory.turns.append(turn)
        trajectory.record.observation_tokens += len(turn.token_ids)
        trajectory.record.turn_texts.append(self.tokenizer.decode(turn.token_ids))
        return True, outputs

    # ---- the loop -------------------------------------------------------------------------------

    def generate(
        self,
        backend: TurnBackend,
        prompts: DataProto,
        sampling: SamplingParams,
        chunks: DecodeChunks | None = None,
    ) -> DataProto:
        """``len(prompts) * n`` trajectories, the n of a prompt in consecutive rows (as a backend's
        responses), each model turn sampled by ``backend``; the response budget is ``max_tokens``.
        ``prompts`` carry their media as :func:`~mmrl.data.processing.attach_media` with
        ``rollout_media`` gives them. ``chunks``: the turns are decoded in chunks, pushes landing
        between them (streaming); their tokens then carry ``policy_version``."""
        repeated, rows, generate = self._trajectory_rows(backend, prompts, sampling, chunks)
        trajectories = self.run(rows, sampling.max_tokens, generate)
        return assemble_trajectory_batch(repeated, trajectories, sampling.max_tokens, backend.pad_token_id)

    def generate_groups(
        self,
        backend: TurnBackend,
        prompts: DataProto,
        sampling: SamplingParams,
        hand_out: Callable[[DataProto], None],
        chunks: DecodeChunks | None = None,
    ) -> None:
        """:meth:`generate`, each prompt's n trajectories handed to ``hand_out`` (a batch of n rows, as
        :meth:`generate` would hold them) as soon as they have all ended, while the other prompts'
        go on (streaming: a group does not wait for the slowest trajectory of its submission)."""
        repeated, rows, generate = self._trajectory_rows(backend, prompts, sampling, chunks)

        def ended(group: range, trajectories: list[Trajectory]) -> None:
            prompt_rows = repeated[group.start : group.stop]
            hand_out(
                assemble_trajectory_batch(
                    prompt_rows, trajectories, sampling.max_tokens, backend.pad_token_id
                )
            )

        self.run(rows, sampling.max_tokens, generate, group_ended=(sampling.n, ended))

    def _trajectory_rows(
        self, backend: TurnBackend, prompts: DataProto, sampling: SamplingParams, chunks: DecodeChunks | None
    ) -> tuple[DataProto, list[dict[str, Any]], GenerateTurns]:
        """The prompt batch with one row per trajectory (uid and media kept per row), what tools and
        environments get of each row, and the backend's turn generator for them."""
        repeated = prompts.repeat(sampling.n, interleave=True)
        generate = backend.turn_generator(repeated, sampling.override(n=1), chunks)
        return repeated, sample_rows(repeated, self.renderer.media), generate

    def run(
        self,
        rows: Sequence[dict[str, Any]],
        budget: int,
        generate: GenerateTurns,
        group_ended: tuple[int, Callable[[range, list[Trajectory]], None]] | None = None,
    ) -> list[Trajectory]:
        """One trajectory per row (the sample's row: what tools and environments get) within ``budget``
        response tokens each. ``group_ended``: ``(size, call)``, the rows in consecutive groups of
        ``size``; ``call(rows, trajectories)`` as soon as a group's trajectories have all ended.

        Each model turn's tool calls (environment step) run on a :class:`BoundedRunner`. ``lockstep``
        (the default): the next turns are sampled together once every call of the turn has returned.
        ``as_ready``: the trajectories whose calls have returned are sampled while the others' still
        run; the engine waits only when no trajectory is ready."""
        trajectories = [Trajectory(media_key=uuid.uuid4().hex) for _ in rows]
        environments = [self.environment() for _ in rows] if self.environment is not None else None
        ready = list(range(len(rows)))
        groups = _GroupsEnded(len(rows), group_ended)
        if environments is not None:
            ready = self._reset(environments, rows, trajectories, budget)
        groups.report(ready, trajectories)
        runner = self._runner()
        observing: dict[int, _Observation] = {}  # row -> its calls (step) in flight
        engine_s = 0.0  # the last model turn's seconds
        while ready or observing:
            if ready:
                requests = [TurnRequest(i, trajectories[i], budget - trajectories[i].length) for i in ready]
                planned, started = {}, time.perf_counter()
                sampled_turns = generate(requests)
                engine_s = time.perf_counter() - started
                for request, sampled in zip(requests, sampled_turns):
                    text = self._model_turn(request, SampledTurn(*sampled))
                    if text is not None and (
                        plan := self._plan(request.row, text, rows, trajectories, environments)
                    ):
                        planned[request.row] = plan
                # the groups that ended with this turn leave before its calls run
                groups.report([*observing, *planned], trajectories)
                for row, plan in planned.items():
                    observing[row] = plan.start(runner)
            ready = self._observed(observing, runner, trajectories, budget, AS_READY_GRACE * engine_s)
            groups.report([*ready, *observing], trajectories)
        return trajectories

    def _runner(self) -> BoundedRunner:
        """Where the calls run: within the tools' bounds, or the environment's (the loop's options)."""
        if self.tools is not None:
            return BoundedRunner(self.tools.timeout_s, self.tools.max_concurrency)
        return BoundedRunner(self.options.timeout_s, self.options.max_concurrency)

    def _observed(
        self,
        observing: dict[int, _Observation],
        runner: BoundedRunner,
        trajectories: list[Trajectory],
        budget: int,
        grace_s: float,
    ) -> list[int]:
        """Wait for observations and append the ones there to their trajectories; the rows that go on, in
        order. lockstep: all of them. as_ready: once one is there, the others for ``grace_s`` more (the
        calls that end together go to the engine together)."""
        runner.collect(block=False)
        give_up = None
        while True:
            there = [row for row in sorted(observing) if observing[row].finished(runner)]
            if len(there) == len(observing):
                break
            if there and self.options.as_ready:
                give_up = give_up or time.perf_counter() + grace_s
                if time.perf_counter() >= give_up:
                    break
                runner.collect(wait_s=give_up - time.perf_counter())
            else:
                runner.collect()
        return [row for row in there if observing.pop(row).finish(runner, trajectories[row], budget)]

    def _plan(
        self,
        row: int,
        text: str,
        rows: Sequence[dict[str, Any]],
        trajectories: list[Trajectory],
        environments: list[Environment] | None,
    ) -> _Plan | None:
        """What answers model turn ``text`` of trajectory ``row``: its tool calls or its environment
        step, not yet started; None when the trajectory ends here (a final answer, ``max_turns``)."""
        trajectory = trajectories[row]
        where = f"row {row}, turn {trajectory.next_turn}"
        if environments is not None:
            step = functools.partial(_guarded, functools.partial(_env_step, environments[row], text))
            return _Plan([step], functools.partial(self._environment_answered, where))
        parsed = self.parse(text)
        if not parsed:
            trajectory.record.stop = STOP_ANSWER
            return None
        if trajectory.record.model_turns >= self.options.max_turns:
            trajectory.record.stop = STOP_MAX_TURNS
            return None
        assert self.tools is not None  # a loop has tools or an environment
        jobs = [self.tools.prepare(call, rows[row]) for call in parsed]
        return _Plan(jobs, functools.partial(self._tools_answered, parsed, where))

    def _tools_answered(
        self, calls: list[ToolCall], where: str, results: list[Any], trajectory: Trajectory, budget: int
    ) -> bool:
        """Append the observation of a turn's tool calls (``results``: as the runner gave them); whether
        the trajectory goes on."""
        assert self.tools is not None
        outputs = [self.tools.answer(call, *result) for call, result in zip(calls, results)]
        appended, shown_outputs = self._append_observation(trajectory, "tool", outputs, budget, where)
        for call, output in zip(calls, shown_outputs):
            trajectory.record.calls.append(_call_record(call.name or "?", call.arguments, output))
        return appended

    def _environment_answered(
        self, where: str, results: list[Any], trajectory: Trajectory, budget: int
    ) -> bool:
        """Record an environment step (its reward, its end) and append its observation; whether the
        trajectory goes on."""
        extra, observation = self._env_output(*results[0])
        reward, done = extra if extra is not None else (0.0, True)
        trajectory.turn_rewards.append(float(reward))
        trajectory.record.calls.append(_call_record("step", None, observation))
        if done:
            trajectory.record.stop = STOP_ANSWER
            return False
        if trajectory.record.model_turns >= self.options.max_turns:
            trajectory.record.stop = STOP_MAX_TURNS
            return False
        return self._append_observation(trajectory, "user", [observation], budget, where)[0]

    def _model_turn(self, request: TurnRequest, sampled: SampledTurn) -> str | None:
        """Append a model turn; its text when the trajectory may go on, else None (stop recorded)."""
        trajectory, ids = request.trajectory, sampled.token_ids
        end = min(len(ids), request.max_tokens)
        end = next((at + 1 for at, token in enumerate(ids[:end]) if token in self.end_of_turn_ids), end)
        ids, log_probs = ids[:end], sampled.log_probs[:end]
        versions = None if sampled.versions is None else list(sampled.versions[:end])
        trajectory.turns.append(
            Turn(trajectory.next_turn, list(ids), True, list(log_probs), versions=versions)
        )
        record = trajectory.record
        record.model_turns += 1
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        record.turn_texts.append(text)
        ended = bool(ids) and ids[-1] in self.end_of_turn_ids
        if not ended:  # cut by the budget mid-turn
            record.stop = STOP_BUDGET
            return None
        return text

    # ---- environments ---------------------------------------------------------------------------

    def _env_output(self, value: Any, seconds: float) -> tuple[Any, ToolOutput]:
        """``(value, observation)`` of an environment call as a :class:`BoundedRunner` gave it (``value``:
        :func:`_guarded`'s); a call that raised, hung or returned an unusable observation gives value
        None and an error observation."""
        if value is TIMED_OUT:
            message = f"the environment took longer than {self.options.timeout_s:g}s"
            return None, error_output(ERROR_TIMEOUT, message, seconds)
        if isinstance(value, ToolOutput):  # an error
            value.seconds = seconds
            return None, value
        observation, extra = value
        observation.seconds = seconds
        return extra, observation

    def _reset(
        self,
        environments: list[Environment],
        rows: Sequence[dict[str, Any]],
        trajectories: list[Trajectory],
        budget: int,
    ) -> list[int]:
        """Each episode's opening observation as turn 0 (none when it is empty); the rows that go on."""
        jobs = [
            functools.partial(_guarded, lambda env=env, row=row: (env.reset(row), None))
            for env, row in zip(environments, rows)
        ]
        outcomes = run_bounded(jobs, self.options.timeout_s, self.options.max_concurrency)
        active = []
        for row, outcome in enumerate(outcomes):
            _, observation = self._env_output(*outcome)
            trajectory = trajectories[row]
            if observation.error is not None:
                trajectory.record.calls.append(_call_record("reset", None, observation))
                trajectory.record.stop = STOP_ANSWER
                continue
            if observation.text or observation.order:
                turn, _ = self._observation(0, "user", [observation], f"row {row}, turn 0")
                trajectory.turns.append(turn)
                trajectory.record.observation_tokens += len(turn.token_ids)
                if trajectory.length >= budget:
                    trajectory.turns.clear()
                    trajectory.record.stop = STOP_BUDGET
                    continue
            active.append(row)
        return active


@dataclass
class _Plan:
    """What will answer a model turn: its jobs (tool calls, or an environment step), each a function or
    an output known without running one (a malformed call), and ``answered(results, trajectory,
    budget)``, which appends their observation and says whether the trajectory goes on."""

    jobs: list[Any]
    answered: Callable[[list[Any], Trajectory, int], bool]

    def start(self, runner: BoundedRunner) -> _Observation:
        parts = [
            (job, job.seconds) if isinstance(job, ToolOutput) else runner.submit(job) for job in self.jobs
        ]
        return _Observation(parts, self.answered)


@dataclass
class _Observation:
    """A planned answer in flight: a runner's ticket per job (or the result known at once)."""

    parts: list[int | tuple[Any, float]]
    answered: Callable[[list[Any], Trajectory, int], bool]

    def finished(self, runner: BoundedRunner) -> bool:
        return all(not isinstance(part, int) or runner.finished(part) for part in self.parts)

    def finish(self, runner: BoundedRunner, trajectory: Trajectory, budget: int) -> bool:
        results = [runner.result(part) if isinstance(part, int) else part for part in self.parts]
        return self.answered(results, trajectory, budget)


class _GroupsEnded:
    """Which groups of consecutive rows (``(size, call)``; none without) have ended, each reported once."""

    def __init__(self, rows: int, group_ended: tuple[int, Callable[[range, list[Trajectory]], None]] | None):
        self.call, self.waiting = None, []
        if group_ended is not None:
            size, self.call = group_ended
            self.waiting = [range(start, min(start + size, rows)) for start in range(0, rows, size)]

    def report(self, active: Sequence[int], trajectories: list[Trajectory]) -> None:
        going_on = set(active)
        ended = [rows for rows in self.waiting if going_on.isdisjoint(rows)]
        self.waiting = [rows for rows in self.waiting if not going_on.isdisjoint(rows)]
        for rows in ended:
            assert self.call is not None  # groups wait only when there is a call
            self.call(rows, trajectories[rows.start : rows.stop])


def _env_step(env: Environment, text: str) -> tuple[Any, tuple[float, bool]]:
    observation, reward, done = env.step(text)
    return observation, (reward, done)


def _guarded(job: Callable[[], Any]) -> Any:
    """``(observation as ToolOutput, extra)`` of an environment call, or an error ToolOutput."""
    try:
        observation, extra = job()
    except Exception as err:  # the environment's failure ends its episode, never the run
        return error_output(ERROR_RAISED, f"{type(err).__name__}: {err}"[:500])
    try:
        return tool_output("" if observation is None else observation), extra
    except TypeError as err:
        return error_output(ERROR_BAD_RETURN, f"the environment returned {err}"[:500])


def _call_record(name: str, arguments: Any, output: ToolOutput) -> ToolCallRecord:
    return ToolCallRecord(
        name=name,
        arguments=arguments,
        seconds=output.seconds,
        error=output.error,
        output=output.text[:LOGGED_OUTPUT_CHARS],
        media=output.describe_media(),
    )


# ---- for the backends ---------------------------------------------------------------------------


def build_agent_loop(
    multi_turn: MultiTurnConfig, media: MediaProcessor, eos_token_ids: Sequence[int], model_type: str
) -> AgentLoop:
    """The loop of the ``worker.rollout.multi_turn`` section (``enable`` checked by the caller)."""
    from mmrl.agent.environments import load_environment
    from mmrl.agent.parsing import tool_call_parser
    from mmrl.agent.tools import load_tools

    options = LoopOptions(
        max_turns=multi_turn.max_turns,
        max_observation_tokens=multi_turn.max_observation_tokens,
        timeout_s=multi_turn.tool_timeout,
        max_concurrency=multi_turn.max_concurrency,
        as_ready=multi_turn.turn_schedule == "as_ready",
    )
    end_of_turn = media.tokenizer.convert_ids_to_tokens(eos_token_ids[0])
    tokenizer_eos = media.tokenizer.eos_token_id
    if tokenizer_eos in eos_token_ids:  # the chat template ends a turn with the tokenizer's EOS
        end_of_turn = media.tokenizer.convert_ids_to_tokens(tokenizer_eos)
    renderer = ObservationRenderer(media, end_of_turn)
    tools = environment = None
    if multi_turn.environment:
        environment = load_environment(multi_turn.environment)
    else:
        tools = ToolRunner(load_tools(multi_turn.tools), multi_turn.tool_timeout, multi_turn.max_concurrency)
    return AgentLoop(renderer, tool_call_parser(model_type), options, eos_token_ids, tools, environment)


def tool_schemas(multi_turn: MultiTurnConfig) -> list[dict[str, Any]] | None:
    """The schemas the prompts' chat template shows the model (``tools=``); None without tools."""
    if not multi_turn.enable or not multi_turn.tools:
        return None
    from mmrl.agent.tools import load_tools

    return [tool.schema for tool in load_tools(multi_turn.tools).values()]


HIDDEN_COLUMNS = (
    "multi_modal_inputs",
    "multi_modal_data",
    "prompt_media",
    "raw_prompt_ids",
    "trajectory_media",
)


def sample_rows(prompts: Any, media: MediaProcessor) -> list[dict[str, Any]]:
    """What tools and environments get of each prompt row (a DataProto): its columns (ground truth,
    uid, the dataset's other columns), its ``images`` at the resolution the data holds them (not scaled
    to ``data.max_pixels``: a zoom returns the detail the prompt's image lost; a sequence decoded when
    first read, once per prompt: :class:`~mmrl.data.processing.SourceImages`), and its ``videos``
    (``[T, H, W, 3]`` frames) and ``audios`` (waveforms) as the model gets them."""
    columns = {key: value for key, value in prompts.non_tensor_batch.items() if key not in HIDDEN_COLUMNS}
    data = prompts.non_tensor_batch.get("multi_modal_data")
    images = source_images(prompts, media)
    rows = []
    for index in range(len(prompts)):
        row = {key: value[index] for key, value in columns.items()}
        decoded = data[index] if data is not None else {}
        row["images"] = images[index]  # shared by the prompt's rows
        row["videos"] = [frames for frames, _ in decoded.get("videos", [])]
        row["audios"] = [waveform for waveform, _ in decoded.get("audios", [])]
        rows.append(row)
    return rows
