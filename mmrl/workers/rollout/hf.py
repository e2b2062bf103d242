"""Transformers rollout: the fallback where vLLM is absent (and the CPU demo's default).

It keeps its own unsharded copy of the policy on the worker's device; after every actor update the
new weights are copied in (``update_weights``), one tensor at a time, exactly as the vLLM backend
receives them. Between generations and the next push the copy is dead weight: :meth:`HFRollout.sleep`
frees it while a training phase runs (vLLM's level-2 sleep), and the next push allocates it again.

Sampling is a plain decode loop over the model's forward with a transformers ``DynamicCache`` whose
layers are preallocated (:class:`PreallocatedLayer`), shaped for GRPO-style rollouts where each prompt
gets n responses:

- the prompt (and its images, videos, audio) is encoded once, and its KV cache copied to its n rows
  (``generate`` would run the prefill and the vision tower n times);
- position ids are computed once per prompt with the model's own ``get_rope_index`` and advanced by
  one per new token (text continues from the prompt's largest id), instead of being re-derived by
  ``generate``'s per-step input preparation;
- sampling draws each token by inverse transform from one seeded uniform per row, after temperature,
  top-k and top-p (the placeholder tokens blocked); greedy is the argmax;
- on a CPU, the large linear layers multiply by weights prepacked by oneDNN (``prepack.py``);
- a MoE model's routing is recorded with ``record_routing`` (every fed token's experts per layer, the
  ``routed_experts`` column) for the actor's routing replay (:mod:`mmrl.models.moe`).

Multi-turn trajectories: the agent loop (:mod:`mmrl.agent`) drives :meth:`HFRollout.turn_generator`,
the same decode loop over each turn's context (the prompt and the trajectory so far).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from mmrl.agent.backend import DecodeChunks, GenerateTurns, SampledTurn, TurnRequest, trajectory_contexts
from mmrl.models.alignment import check_media_alignment
from mmrl.models.families import family_of
from mmrl.models.inputs import compute_position_ids, joined_media, next_text_position
from mmrl.models.moe import FREE, ROUTED_EXPERTS, RouterRecorder
from mmrl.protocol import DataProto
from mmrl.workers.rollout import SamplingParams, assemble_rollout_batch, eos_token_ids
from mmrl.workers.rollout.prepack import PrepackedLinear, prepack_linears
from mmrl.workers.weight_sync import load_into


class PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys``/``values`` are views of buffers with room for ``capacity``
    positions: each new token is written in place, where ``DynamicLayer`` concatenates (copies) the
    whole cache at every step (a third of a CPU decode step's time at 64 rows x 100 positions)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = self._key_buffer[:, :, : self.length]
        self.values = self._value_buffer[:, :, : self.length]
        return self.keys, self.values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key_states.shape[-2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            batch, heads, _, dim = key_states.shape
            size = (batch, heads, max(self.capacity, end), dim)
            self._key_buffer, self._value_buffer = key_states.new_empty(size), value_states.new_empty(size)
        elif end > self._key_buffer.shape[-2]:  # past the planned capacity: grow, keeping what is there
            grow = (0, 0, 0, end - self._key_buffer.shape[-2])
            self._key_buffer = torch.nn.functional.pad(self._key_buffer, grow)
            self._value_buffer = torch.nn.functional.pad(self._value_buffer, grow)
        self._key_buffer[:, :, self.length : end] = key_states
        self._value_buffer[:, :, self.length : end] = value_states
        self.length = end
        return self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length > 0:
            self._key_buffer = self._key_buffer.repeat_interleave(repeats, dim=0)
            self._value_buffer = self._value_buffer.repeat_interleave(repeats, dim=0)
            self._views()


def preallocated_cache(config: Any, capacity: int) -> DynamicCache:
    """The model's ``DynamicCache`` with its plain layers preallocated for ``capacity`` positions
    (sliding-window or other special layers are kept as transformers builds them)."""
    cache = DynamicCache(config=config)
    if cache.layers:
        cache.layers = [
            PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers
        ]
    return cache


def repeat_cache_rows(cache: DynamicCache, repeats: int) -> None:
    """``cache.batch_repeat_interleave(repeats)``, also for linear-attention layers (Qwen3.5's gated
    delta nets), whose transformers cache class (5.19) lacks it: their convolution windows and
    recurrence states repeat row by row, as keys and values do."""
    for layer in cache.layers:
        if hasattr(layer, "batch_repeat_interleave"):
            layer.batch_repeat_interleave(repeats)
            continue
        for states in (layer.conv_states, layer.recurrent_states):  # {state index: [B, ...] | None}
            for index, state in states.items():
                if state is not None:
                    states[index] = state.repeat_interleave(repeats, dim=0)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` [B, V] with every token outside the top-k (``top_k`` > 0) and outside the smallest set
    whose probability reaches ``top_p`` (< 1) set to -inf; the most likely token always stays."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p  # the mass before it already reached p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``logits`` [B, V], drawn from ``softmax(logits)`` by inverse transform: the
    first token whose cumulative probability exceeds ``u ~ U[0, 1)`` times the total (one uniform per
    row; float64 sums, so rounding cannot land on a token of probability 0)."""
    cdf = logits.double().softmax(-1).cumsum(-1)  # [B, V]
    uniform = torch.rand(len(cdf), 1, generator=generator, device=cdf.device, dtype=torch.float64)
    tokens = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(-1)
    last_possible = (logits > float("-inf")).cumsum(-1).argmax(-1)  # first index reaching the final count
    return torch.minimum(tokens, last_possible)


class HFRollout:
    """Samples on this process's share of the prompts with the model's forward and a KV cache."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        micro_batch_size: int = 64,
        return_log_probs: bool = False,
        prepack: bool = True,
        record_routing: bool = False,
    ):
        self.model = model.eval()
        if prepack:  # on a CPU: large linear layers multiply by oneDNN-prepacked weights
            prepack_linears(self.model, rows=micro_batch_size)
        self.tokenizer = tokenizer
        self.micro_batch_size = micro_batch_size  # responses decoded together
        self.return_log_probs = return_log_probs
        # a MoE model: each token's experts per layer, as the ``routed_experts`` column (routing replay)
        self.routing = RouterRecorder(self.model) if record_routing else None
        self.eos_token_ids = eos_token_ids(tokenizer, getattr(model, "generation_config", None))
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        )
        self.family = family_of(model)
        # sampling a token only the processor may place breaks re-scoring of the response ("Image
        # features and image tokens do not match"): they are suppressed during generation
        self.blocked_token_ids = self.family.placeholder_token_ids(tokenizer)
        # every parameter (tied ones once) with the shape it is given back when weights arrive
        self._parameter_shapes = [(parameter, parameter.shape) for parameter in self.model.parameters()]
        self.weights_discarded = False  # sleep() freed the weights: push new ones before generating

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.weights_discarded:  # storage again for what arrives (uninitialised: all of it is written)
            for parameter, shape in self._parameter_shapes:
                parameter.data = torch.empty(shape, dtype=parameter.dtype, device=parameter.device)
        load_into(self.model, named_tensors)  # every tensor must arrive: a partial sync is an error
        self.weights_discarded = False

    def sleep(self) -> None:
        """Free the weights (and packed copies) until the next :meth:`update_weights`: a training phase
        needs the memory, and the next generation gets the next update's weights anyway."""
        if self.weights_discarded:
            return
        for parameter, _ in self._parameter_shapes:
            parameter.data = parameter.data.new_empty(0)
        for module in self.model.modules():
            if isinstance(module, PrepackedLinear):
                module.drop_packed()
        self.weights_discarded = True

    def _prefill(
        self, prompts: DataProto, n: int, max_tokens: int
    ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor]:
        """Encode each prompt once (its cache sized for ``max_tokens`` more); returns its next-token
        logits [G * n, V], the KV cache, the attention
        mask and the next position ids (the prompt's largest id + 1) ``[A, G * n]`` on each of the A
        rotary axes (3 for M-RoPE, else 1), everything repeated n times."""
        device = self.device
        input_ids = prompts.batch["input_ids"].to(device)
        attention_mask = prompts.batch["attention_mask"].to(device)
        media = {}
        if "multi_modal_inputs" in prompts.non_tensor_batch:
            # announced to the towers' encoding caches, which the step's passes then reuse
            media = joined_media(self.model, list(prompts.non_tensor_batch["multi_modal_inputs"]), device)
        token_types = (
            prompts.batch["mm_token_type_ids"] if "mm_token_type_ids" in prompts.batch.keys() else None
        )
        check_media_alignment(
            self.model.config,
            input_ids,
            prompts.non_tensor_batch.get("multi_modal_inputs"),
            names=[f"prompt row {row}" for row in range(len(prompts))],
        )
        position_ids = compute_position_ids(
            self.model,
            input_ids,
            attention_mask,
            media,
            None if token_types is None else token_types.to(device),
        )  # [3, G, P] or [G, P]
        cache = preallocated_cache(self.model.config, input_ids.shape[1] + max_tokens)
        logits = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **self.family.forward_media(media),
        ).logits[:, -1]
        axes = position_ids.shape[0] if position_ids.dim() == 3 else 1
        next_position = next_text_position(position_ids, attention_mask)  # [G]
        repeat_cache_rows(cache, n)
        return (
            logits.repeat_interleave(n, dim=0),
            cache,
            attention_mask.repeat_interleave(n, dim=0),
            next_position.repeat_interleave(n, dim=0).expand(axes, -1),
        )

    def _blocked(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.blocked_token_ids, device=device)

    def _sample(
        self, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next tokens [B] from raw ``logits`` [B, V], and their log-probs under ``softmax(logits / T)``
        (the trainer's distribution; top-k/top-p only restrict what is drawn)."""
        scaled = logits.float() if sampling.greedy else logits.float() / sampling.temperature
        allowed = scaled
        if self.blocked_token_ids:
            allowed = scaled.index_fill(-1, self._blocked(scaled.device), float("-inf"))
        if sampling.greedy:
            tokens = allowed.argmax(-1)
        else:
            tokens = sample_tokens(filter_logits(allowed, sampling.top_k, sampling.top_p), generator)
        if not self.return_log_probs:
            return tokens, None
        log_probs = torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return tokens, log_probs

    def _routed(self, valid: torch.Tensor) -> torch.Tensor:
        """The last forward's experts as [rows, tokens, layers, k], :data:`FREE` where ``valid`` [rows,
        tokens] is False; the recorder is cleared for the next forward."""
        experts = self.routing.layer_experts().to(torch.int16)  # [rows * tokens, layers, k]
        experts = experts.view(*valid.shape, *experts.shape[1:])
        self.routing.begin()
        return experts.masked_fill(~valid.to(experts.device).bool()[..., None, None], FREE)

    @torch.inference_mode()  # its outputs are joined by generate() outside it, into normal tensors
    def _generate_micro_batch(
        self, prompts: DataProto, sampling: SamplingParams, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``len(prompts) * n`` responses [B, r <= max_tokens] (rows of a prompt together), their
        log-probs (or None) and, recording routing, every fed token's experts [B, P + r, layers, k]
        (the last response token is never fed: :data:`FREE`, as are padding and tokens after EOS)."""
        with self.routing.recording() if self.routing is not None else contextlib.nullcontext():
            return self._decode(prompts, sampling, generator)

    def _decode(
        self, prompts: DataProto, sampling: SamplingParams, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        decode = PartialDecode(self, prompts, sampling, generator)
        decode.advance(sampling.max_tokens)
        return decode.responses(), decode.log_probs(), decode.routing()

    def _generator(self, sampling: SamplingParams) -> torch.Generator:
        if self.weights_discarded:
            raise RuntimeError(
                "HFRollout: sleep() freed the weights; push weights with update_weights before generating "
                "(HybridWorker does so when weights_discarded is set)"
            )
        return torch.Generator(device=self.device).manual_seed(sampling.seed)  # per step and rank

    def _pad_width(self, tensor: torch.Tensor, width: int, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(tensor, (0, width - tensor.shape[-1]), value=value)

    def generate(self, prompts: DataProto, sampling: SamplingParams) -> DataProto:
        """``len(prompts) * n`` responses, the n of a prompt in consecutive rows (``[a, a, b, b]``),
        decoded ``micro_batch_size`` responses (whole prompts) at a time."""
        generator = self._generator(sampling)
        prompts_per_pass = max(1, self.micro_batch_size // sampling.n)
        responses, log_probs, routing = [], [], []
        width = prompts.batch["input_ids"].shape[1] + sampling.max_tokens
        for part in prompts.split(prompts_per_pass):
            part_responses, part_log_probs, part_routing = self._generate_micro_batch(
                part, sampling, generator
            )
            responses.append(self._pad_width(part_responses.cpu(), sampling.max_tokens, self.pad_token_id))
            if part_log_probs is not None:
                log_probs.append(self._pad_width(part_log_probs.cpu(), sampling.max_tokens, 0.0))
            if part_routing is not None:  # [b, P + r, layers, k] -> [b, P + max_tokens, layers, k]
                pad = (0, 0, 0, 0, 0, width - part_routing.shape[1])
                routing.append(torch.nn.functional.pad(part_routing.cpu(), pad, value=FREE))
        batch = assemble_rollout_batch(
            prompts.repeat(sampling.n, interleave=True),  # uid and media kept per row
            torch.cat(responses, dim=0),
            self.eos_token_ids,
            self.pad_token_id,
            ignore_eos=sampling.ignore_eos,
            rollout_log_probs=torch.cat(log_probs, dim=0) if log_probs else None,
        )
        if routing:
            batch.batch[ROUTED_EXPERTS] = torch.cat(routing, dim=0)
        return batch

    def turn_generator(
        self, prompts: DataProto, sampling: SamplingParams, chunks: DecodeChunks | None = None
    ) -> GenerateTurns:
        """Model turns for the agent loop (:class:`mmrl.agent.backend.TurnBackend`): the requests'
        contexts (prompt and trajectory so far, media of every turn included) are decoded
        ``micro_batch_size`` at a time, all turns of a generation drawing from one seeded stream.
        ``chunks`` (streaming): each micro-batch decoded ``chunks.tokens`` at a time, holding the
        engine only for a chunk; new weights between two chunks continue the turn as a partial
        rollout does (:class:`PartialDecode`), and each id records its version."""
        generator = self._generator(sampling)

        def generate_turns(requests: Sequence[TurnRequest]) -> list[SampledTurn]:
            turns = []
            for start in range(0, len(requests), self.micro_batch_size):
                part = requests[start : start + self.micro_batch_size]
                contexts = trajectory_contexts(prompts, part, self.pad_token_id)
                turn_sampling = sampling.override(n=1, max_tokens=max(request.max_tokens for request in part))
                if chunks is None:
                    tokens, log_probs, _ = self._generate_micro_batch(contexts, turn_sampling, generator)
                    versions = [None] * len(tokens)
                else:
                    decode = self._decode_in_chunks(contexts, turn_sampling, generator, chunks)
                    tokens, log_probs = decode.responses(), decode.log_probs()
                    versions = decode.versions().tolist()
                if log_probs is None:
                    log_probs = torch.zeros(tokens.shape)
                turns += [
                    SampledTurn(ids, lps, row_versions)
                    for ids, lps, row_versions in zip(tokens.tolist(), log_probs.tolist(), versions)
                ]
            return turns

        return generate_turns

    def _decode_in_chunks(
        self, contexts: DataProto, sampling: SamplingParams, generator: torch.Generator, chunks: DecodeChunks
    ) -> PartialDecode:
        """One micro-batch of turns decoded ``chunks.tokens`` at a time, the engine held for each chunk
        (and the prefill) only; the weights in it at each chunk's start sample that chunk."""
        with chunks.engine():
            decode = PartialDecode(self, contexts, sampling, generator, chunks.version)
        while not decode.done:
            with chunks.engine():
                decode.reload(chunks.version)
                decode.advance(chunks.tokens)
        return decode

    def stream(self, prompts: DataProto, sampling: SamplingParams, version: int) -> StreamedGeneration:
        """A training generation of ``prompts`` handed out group by group as the prompts finish, its
        tokens stamped with the policy version that sampled them (:class:`StreamedGeneration`)."""
        return StreamedGeneration(self, prompts, sampling, version)


class PartialDecode:
    """One micro-batch of whole prompts (their n rows each) decoded a chunk of tokens at a time, so that
    new weights may arrive between chunks (``trainer.async_mode=stream``, partial rollouts).

    :meth:`advance` samples up to k more tokens per row; :meth:`reload` says the engine now holds
    other weights (policy ``version``): before the next token the prompts and the tokens sampled so far
    are encoded again by them (a new KV cache, AReaL's choice), so every later token is exactly what the
    new weights sample after that prefix. ``versions()`` gives each sampled token the version of the
    weights whose logits it was drawn from. Decoding it in one :meth:`advance` of ``max_tokens`` is
    :meth:`HFRollout.generate`'s own loop."""

    def __init__(
        self,
        rollout: HFRollout,
        prompts: DataProto,
        sampling: SamplingParams,
        generator: torch.Generator,
        version: int = 0,
    ):
        self.rollout, self.prompts, self.sampling, self.generator = rollout, prompts, sampling, generator
        self.version = version
        with torch.inference_mode():
            self.logits, self.cache, self.attention_mask, self.next_position = rollout._prefill(
                prompts, sampling.n, sampling.max_tokens
            )
        self.routed = None
        if rollout.routing is not None:  # the prompts' routing, copied to their n rows
            self.routed = [
                rollout._routed(prompts.batch["attention_mask"]).repeat_interleave(sampling.n, dim=0)
            ]
        self.padded = not bool(self.attention_mask.all())  # without padding, decoding needs no mask at all
        self.eos = torch.tensor(rollout.eos_token_ids, device=self.logits.device)
        self.finished = torch.zeros(self.logits.shape[0], dtype=torch.bool, device=self.logits.device)
        self.tokens: list[torch.Tensor] = []
        self.token_log_probs: list[torch.Tensor] = []
        self.token_versions: list[int] = []
        self.done = False
        self.stale = False  # reload() was called: the cache and logits are the old weights'

    def reload(self, version: int) -> None:
        """The engine holds the weights of policy ``version`` now: re-encode before the next token."""
        if version != self.version:
            self.version, self.stale = version, True

    def _reencode(self) -> None:
        """The KV cache and next-token logits of the prompts and the tokens sampled so far, by the
        engine's current weights: the prompts' prefill, then every sampled token fed in one forward at
        the positions the decode gave them."""
        rollout, count = self.rollout, len(self.tokens)
        self.logits, self.cache, prompt_mask, self.next_position = rollout._prefill(
            self.prompts, self.sampling.n, self.sampling.max_tokens
        )
        if count == 0:
            self.stale = False
            return
        sampled = torch.stack(self.tokens, dim=1)  # [B, count], every one already fed before the reload
        self.attention_mask = torch.cat([prompt_mask, prompt_mask.new_ones(sampled.shape)], dim=-1)
        offsets = torch.arange(count, device=sampled.device)
        position = self.next_position.unsqueeze(-1) + offsets  # [A, B, count]
        self.logits = rollout.model(
            input_ids=sampled,
            attention_mask=self.attention_mask,
            position_ids=position if len(position) == 3 else position[0],
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        self.stale = False

    @torch.inference_mode()
    def advance(self, max_new_tokens: int) -> None:
        """Sample up to ``max_new_tokens`` more tokens per row (fewer when every row ends first)."""
        if self.stale and not self.done:
            self._reencode()
        rollout, sampling = self.rollout, self.sampling
        for _ in range(max_new_tokens):
            if self.done:
                return
            step = len(self.tokens)
            token, token_log_prob = rollout._sample(self.logits, sampling, self.generator)
            token = token.masked_fill(self.finished, rollout.pad_token_id)
            fed = ~self.finished  # [B]: a real token (not padding after EOS) if it is fed back
            self.tokens.append(token)
            self.token_versions.append(self.version)
            if token_log_prob is not None:
                self.token_log_probs.append(token_log_prob.masked_fill(self.finished, 0.0))
            if not sampling.ignore_eos:
                self.finished |= torch.isin(token, self.eos)
            if step == sampling.max_tokens - 1 or bool(self.finished.all()):
                self.done = True
                return
            if self.padded:
                self.attention_mask = torch.cat(
                    [self.attention_mask, self.attention_mask.new_ones(len(token), 1)], dim=-1
                )
            position = (self.next_position + step).unsqueeze(-1)  # [A, B, 1]
            self.logits = rollout.model(
                input_ids=token.unsqueeze(-1),
                attention_mask=self.attention_mask if self.padded else None,
                position_ids=position if len(position) == 3 else position[0],
                past_key_values=self.cache,
                use_cache=True,
            ).logits[:, -1]
            if self.routed is not None:
                self.routed.append(rollout._routed(fed.unsqueeze(-1)))

    def finished_prompts(self) -> list[int]:
        """The prompts (indices into ``prompts``) all of whose n responses have ended (all, once done)."""
        if self.done:
            return list(range(len(self.prompts)))
        ended = self.finished.view(len(self.prompts), self.sampling.n).all(dim=-1)
        return ended.nonzero().flatten().tolist()

    def responses(self) -> torch.Tensor:
        return torch.stack(self.tokens, dim=1)  # [B, r]

    def log_probs(self) -> torch.Tensor | None:
        return torch.stack(self.token_log_probs, dim=1) if self.token_log_probs else None

    def versions(self) -> torch.Tensor:
        """[B, r]: the policy version each sampled token was drawn by."""
        versions = torch.tensor(self.token_versions, dtype=torch.long)
        return versions.expand(len(self.finished), -1).clone()

    def routing(self) -> torch.Tensor | None:
        return torch.cat(self.routed, dim=1) if self.routed is not None else None


class StreamedGeneration:
    """A training generation handed out group by group (``trainer.async_mode=stream``): the prompts'
    micro-batches (``micro_batch_size`` responses, whole prompts) decoded one after the other, in the
    order and with the random stream :meth:`HFRollout.generate` uses, ``advance(k)`` tokens at a time;
    :meth:`take_finished` returns the prompts whose n responses have all ended since the last call, as
    rollout rows with each token's ``policy_version``. A micro-batch is prefilled when its turn comes,
    by the weights the engine then holds."""

    def __init__(self, rollout: HFRollout, prompts: DataProto, sampling: SamplingParams, version: int):
        self.rollout, self.sampling, self.version = rollout, sampling, version
        self.generator = rollout._generator(sampling)
        self.waiting = list(prompts.split(max(1, rollout.micro_batch_size // sampling.n)))
        self.current: PartialDecode | None = None
        self.handed_out: set[int] = set()  # prompts of the current micro-batch already returned

    @property
    def done(self) -> bool:
        return self.current is None and not self.waiting

    def reload(self, version: int) -> None:
        """New weights (policy ``version``) in the engine: the micro-batch in progress re-encodes."""
        self.version = version
        if self.current is not None:
            self.current.reload(version)

    def advance(self, max_new_tokens: int) -> None:
        if self.current is None and self.waiting:
            self.current = PartialDecode(
                self.rollout, self.waiting.pop(0), self.sampling, self.generator, self.version
            )
            self.handed_out = set()
        if self.current is not None:
            self.current.advance(max_new_tokens)

    def take_finished(self) -> DataProto | None:
        """The rows (n per prompt, the prompt's columns repeated) of the prompts finished since the
        last call, padded to ``max_tokens``; None when there are none."""
        decode = self.current
        if decode is None:
            return None
        prompts = [index for index in decode.finished_prompts() if index not in self.handed_out]
        self.handed_out.update(prompts)
        if decode.done:
            self.current = None
        if not prompts:
            return None
        n, width, rollout = self.sampling.n, self.sampling.max_tokens, self.rollout
        rows = [prompt * n + k for prompt in prompts for k in range(n)]
        responses = rollout._pad_width(decode.responses()[rows].cpu(), width, rollout.pad_token_id)
        versions = decode.versions()[rows]
        versions = torch.nn.functional.pad(versions, (0, width - versions.shape[-1]), value=decode.version)
        log_probs = decode.log_probs()
        batch = assemble_rollout_batch(
            decode.prompts[prompts].repeat(n, interleave=True),
            responses,
            rollout.eos_token_ids,
            rollout.pad_token_id,
            ignore_eos=self.sampling.ignore_eos,
            rollout_log_probs=None
            if log_probs is None
            else rollout._pad_width(log_probs[rows].cpu(), width, 0.0),
        )
        batch.batch["policy_version"] = versions
        return batch
