"""An engine that generates all the time (``trainer.async_mode=stream``): submitted training generations
are decoded by a thread of their own, ``chunk_tokens`` tokens per row at a time, the oldest first; each
prompt's n responses are queued as soon as they have all ended. Anything else that needs the engine
(a weight push, validation, greedy baselines) :meth:`StreamingEngine.hold`\\ s it: it waits for the chunk
in progress to end, and no chunk starts while it holds it. After new weights, :meth:`reload` lets the
generations in flight continue with them (partial rollouts: transformers'
:class:`mmrl.workers.rollout.hf.PartialDecode`, vLLM's
:class:`mmrl.workers.rollout.vllm_spmd.StreamedVLLMGeneration`).

Multi-turn trajectories (an agent given): a submission's trajectories are run by the agent loop in this
thread (:class:`AgentStream`), each model turn decoded a chunk at a time as above; the engine is held
for a chunk only, so a push also lands while the tools run: a tool call in flight completes, and the
turns after it are sampled by the new weights. The loop runs a submission's trajectories turn by turn
together, or each as its calls return (``multi_turn.turn_schedule``); each prompt's group leaves as soon as its trajectories have all ended, while the others go
on (:meth:`mmrl.agent.loop.AgentLoop.generate_groups`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from mmrl.protocol import DataProto
from mmrl.workers.rollout import SamplingParams


class _Stopped(Exception):
    """The engine stopped while a trajectory waited for it."""


class AgentStream:
    """A training generation of multi-turn trajectories (``agent``: :class:`mmrl.agent.loop.AgentLoop`)
    for the streaming thread; it is the :class:`mmrl.agent.backend.DecodeChunks` its turns decode by."""

    def __init__(
        self,
        streaming: StreamingEngine,
        agent: Any,
        prompts: DataProto,
        sampling: SamplingParams,
        version: int,
    ):
        self.streaming, self.agent, self.prompts, self.sampling = streaming, agent, prompts, sampling
        self.tokens = streaming.chunk_tokens
        self.version = version  # of the weights in the engine; reload() keeps it current
        self.done = False

    def engine(self) -> AbstractContextManager[None]:
        return self.streaming.chunk()

    def reload(self, version: int) -> None:
        """New weights in the engine (called while the engine is held): the next chunk samples by them."""
        self.version = version

    def run(self) -> None:
        """Every trajectory of the submission, to its end, each prompt's group (its rows together, each
        token's ``policy_version`` included) handed out as soon as it has ended."""
        self.agent.generate_groups(
            self.streaming.engine, self.prompts, self.sampling, self.streaming.hand_out, chunks=self
        )
        self.done = True


class StreamingEngine:
    """``engine`` (either rollout backend: its ``stream`` method) driven by a thread of this process."""

    def __init__(self, engine: Any, chunk_tokens: int):
        self.engine, self.chunk_tokens = engine, chunk_tokens
        self.changed = threading.Condition()
        self.streams: list[Any] = []  # submitted generations, oldest first
        self.outbox: list[DataProto] = []  # finished groups not yet taken
        self.holders = 0  # callers waiting for, or holding, the engine
        self.decoding = False  # a chunk is being decoded
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.stopping = False

    @contextmanager
    def hold(self) -> Iterator[None]:
        """The engine to the caller, once the chunk in progress has ended."""
        with self.changed:
            self.holders += 1
            self.changed.wait_for(lambda: not self.decoding)
        try:
            yield
        finally:
            with self.changed:
                self.holders -= 1
                self.changed.notify_all()

    @contextmanager
    def chunk(self) -> Iterator[None]:
        """The engine to the streaming thread for one chunk (or prefill), once nobody holds it."""
        with self.changed:
            self.changed.wait_for(lambda: self.stopping or not self.holders)
            if self.stopping:
                raise _Stopped
            self.decoding = True
        try:
            yield
        finally:
            with self.changed:
                self.decoding = False
                self.changed.notify_all()

    def reload(self, version: int) -> None:
        """The engine holds the weights of policy ``version`` now (call it while holding the engine):
        the generations in flight continue with them."""
        for stream in self.streams:
            stream.reload(version)

    def submit(self, prompts: DataProto, sampling: SamplingParams, version: int, agent: Any = None) -> None:
        """A training generation of ``prompts`` (media attached), after those submitted before;
        trajectories run by ``agent`` when it is given."""
        with self.changed:
            if agent is None:
                self.streams.append(self.engine.stream(prompts, sampling, version))
            else:
                self.streams.append(AgentStream(self, agent, prompts, sampling, version))
            self.changed.notify_all()
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="stream", daemon=True)
            self.thread.start()

    def take(self, timeout_s: float) -> list[DataProto]:
        """The groups finished since the last call, waiting up to ``timeout_s`` for one; the thread's
        failure is raised here."""
        with self.changed:
            self.changed.wait_for(lambda: self.outbox or self.error is not None, timeout=timeout_s)
            if self.error is not None:
                raise RuntimeError("the streaming generation failed") from self.error
            parts, self.outbox = self.outbox, []
        return parts

    def hand_out(self, group: DataProto) -> None:
        """A finished group, for the next :meth:`take`."""
        with self.changed:
            self.outbox.append(group)
            self.changed.notify_all()

    def stop(self) -> None:
        with self.changed:
            self.stopping = True
            self.changed.notify_all()

    def _loop(self) -> None:
        """Decode the oldest generation a chunk at a time while nobody holds the engine."""
        try:
            while True:
                with self.changed:
                    self.changed.wait_for(lambda: self.stopping or self.streams)
                    if self.stopping:
                        return
                    stream = self.streams[0]
                finished = None
                try:
                    if isinstance(stream, AgentStream):
                        stream.run()  # holds the engine chunk by chunk, hands out each group itself
                    else:
                        with self.chunk():
                            stream.advance(self.chunk_tokens)
                            finished = stream.take_finished()
                finally:
                    with self.changed:
                        if stream.done:
                            self.streams.remove(stream)
                        if finished is not None:
                            self.outbox.append(finished)
                        self.changed.notify_all()
        except _Stopped:
            return
        except BaseException as error:  # the caller learns it at its next take
            with self.changed:
                self.error = error
                self.changed.notify_all()
