"""Actor update of a real-size Qwen2.5-VL (random weights): tokens/s and MFU on one GPU, aten ops per
update on the CPU, for mmrl and for a plain FSDP2 loop written here.

    python bench/gpu_mfu.py [--model 3b|7b] [--rows 16] [--prompt_length 512] [--response_length 512]
                            [--micro_batch 4] [--repeats 3] [--gradient_checkpointing]
                            [--baseline plain] [--peak_tflops 989]
    python bench/gpu_mfu.py --sides mmrl:full,mmrl:full+compile,mmrl:off+compile,plain:full,plain:off
    python bench/gpu_mfu.py --sides mmrl:full+compile,mmrl:full+compile+head,mmrl:28+compile+keep+hold,plain:full
                            [--profile_sides mmrl:full+compile,plain:full]
    python bench/gpu_mfu.py --varied --sides plain:full,mmrl:full+compile,mmrl:full+compile+budget
    python bench/gpu_mfu.py --device cpu   # op counts (the default without CUDA): 3B widths, 2 layers
    python bench/gpu_mfu.py --device cpu --widths small   # the same counts at narrow widths (fast)
    python bench/gpu_mfu.py --smoke [--baseline plain]   # the timed path on the CPU, tiny config (a check)

GPU mode. The model is built from a config dict written here (the published Qwen2.5-VL-3B/7B-Instruct
sizes; nothing is downloaded), with random fp32 weights (seed 0) on the GPU. mmrl's side is the
trainer's: ``prepare_for_training``, mmrl's ``apply_fsdp2`` on a one-rank group with bf16 compute and
fp32 reduction, AdamW from ``build_optimizer``, one ``PolicyActor.update_policy`` (PPO loss, one
optimizer step over micro-batches of ``--micro_batch`` rows, padding-free). Work: ``--rows`` text rows
of ``--prompt_length`` random prompt and ``--response_length`` random response tokens, every token
valid; ``--varied`` pads them as a rollout hands them over (left-padded prompts, responses of 1/8 to
all of ``--response_length`` in a random row order: micro-batches of so many rows then hold uneven
token counts; ``--ragged`` pads them less): mmrl packs the valid tokens, the plain loop passes the
attention mask, and tokens/s and MFU count the valid tokens. With
``--baseline plain`` the same model (same seed) and batch go through :class:`PlainSide` too: a plain
FSDP2 loop (``fully_shard`` per decoder layer and vision block, the same mixed precision, fused AdamW,
``logits_to_keep`` for the response tokens, a log-softmax gather, the same PPO loss, torch's
``clip_grad_norm_``). mmrl's batch carries its ``position_ids`` column, numbered once as the trainer
numbers a rollout batch. Each side: a warm-up update, then ``--repeats`` timed ones (median,
``torch.cuda.synchronize`` around each; the GPU's SM clock and power draw sampled over them through
NVML where torch reads it: a side whose kernels each take longer at a lower clock is power-bound, not
slower code), the optimizer step timed on its own (clipping included), the
no-grad log-prob pass timed, and one update profiled: host-bound share = CPU time of the ops (self,
summed) / GPU kernel time (kernels only, each counted once); above 1 the GPU waits on the host. GPU
busy = that kernel time / the median update's seconds. The profiled update's kernel time by kind
(matrix products, eager elementwise, compiled Triton kernels, copies and casts, reductions, attention,
optimizer, collectives) and its top ops and kernels by device time are printed for each side.
``--sides`` times several settings in one process on the same weights and batch, each
``name:checkpointing[+option...]``: ``mmrl`` or ``plain``; ``full`` (whole layers recomputed in the
backward), ``off``, or a count N (only the first N decoder layers recompute, the others keep their
activations: the trainer's ``worker.actor.model.gradient_checkpointing_layers``); options ``+compile``
(mmrl only: its decoder layers compiled, ``worker.actor.model.compile_layers``), ``+head`` (mmrl only:
its log-prob head's chunk math compiled, ``worker.actor.model.compile_head``), ``+keep`` (FSDP keeps
each unit's gathered parameters from its forward to its backward: ``worker.actor.fsdp.enable_full_shard
=false``), ``+hold`` (mmrl only: and from a micro-batch's backward to the next one's forward,
``worker.actor.keep_params_gathered``), ``+once`` (mmrl only: one gradient reduction per
optimizer step, ``worker.actor.reduce_grads_once``), ``+budget`` (mmrl only: micro-batches of at most
``--max_tokens`` packed tokens, by default what ``--micro_batch`` unpadded rows hold, instead of
``--micro_batch`` rows: ``worker.actor.max_tokens_per_micro_batch``; the table gives each side's
micro-batches per update). A side that fails is reported and the others still run.
``--profile_sides`` profiles only those (profiling takes an update and its analysis per side). At least
one mmrl side must run: the figures at the top level of the output are the first one's.

FLOPs (:func:`update_flops`): matmul FLOPs of the forward pass (2 per multiply-add) times 3 for
forward + backward: per layer and token, the q/k/v/o projections and the SwiGLU MLP; per sequence, the
causal attention scores and weighted sum (2 · 2 · d_model · S(S+1)/2 per layer); the LM head only for
the response tokens. Recomputation under gradient checkpointing is not counted (model FLOPs, not
hardware FLOPs); norms, rotary and softmax are left out. MFU = FLOPs / (seconds × peak dense bf16
FLOP/s of the GPU: H100/H200 989 TFLOP/s, A100 312; ``--peak_tflops`` for others).

CPU mode (``--device cpu``; the default without CUDA): what host work each side does, counted, not
timed. The 3B widths with 2 decoder layers (``--layers``), the vision tower at its real width with 2
blocks, bf16 compute / fp32 master weights as on a GPU, gloo, one rank, gradient checkpointing on. The
vocabulary is cut to ``--vocab`` rows (default 8,192; the released 151,936 would hold ~9 GB of fp32
weights, gradients and Adam moments per model on a shared box): no op count depends on it, nor on
the widths (``--widths small``: the 3B layout of heads at narrow widths, minutes instead of hours on a
CPU without bf16 instructions). Every aten
op dispatched (a ``TorchDispatchMode`` below autograd: forward, backward, FSDP2's copies, optimizer)
is counted, split into the micro-batch loop and the optimizer step (clipping included), over three
runs per side after a warm-up: L layers and 2 micro-batches, L layers and 1 micro-batch of the same
rows, half the rows in 2 micro-batches, 1 layer and 2 micro-batches. Printed per update, per micro-batch, per decoder layer (fwd + bwd, one micro-batch), per
extra row in a micro-batch, per parameter tensor in the optimizer step, and for the no-grad log-prob
pass per micro-batch; columns: all ops, ``copy_``, ``_to_copy`` (dtype/device casts), host syncs
(``_local_scalar_dense``: ``.item()``, ``float()``, ``.tolist()``) and ops on DTensors; then the
counted update's loss and gradient norm on both sides (equal up to bf16 rounding). The rows have no
padding, so mmrl runs each micro-batch as the dense batch it is; ``--ragged`` pads them unevenly
(left-padded prompts, right-padded responses, as a rollout hands rows over): mmrl then packs them,
and the plain loop passes the attention mask. Tables and before/after figures: docs/throughput.md.

Runs on the torch it finds: one without ``FSDPModule.set_reduce_scatter_unused_params`` (< 2.13) gets
a no-op in its place (said in the output). Writes ``bench/results/gpu_mfu.json`` (``gpu_mfu_ops.json``
in the CPU mode, ``gpu_mfu_smoke.json`` with ``--smoke``; ``--out`` another file).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

RESULTS = Path(__file__).resolve().parent / "results"

# Published sizes of Qwen2.5-VL-{3B,7B}-Instruct (text decoder and vision tower); vocabulary as released.
TEXT_CONFIGS = {
    "3b": {
        "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
        "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
    },
    "7b": {
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
    },
    # --device cpu --widths small: the 3B layout (heads, kv heads) at narrow widths; the same op counts
    "small": {
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 36, "num_attention_heads": 16,
        "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
    },
    # --smoke: the same architecture, small enough for a CPU check
    "smoke": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 512, "tie_word_embeddings": True,
    },
}  # fmt: skip
VISION_CONFIGS = {
    "3b": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16},
    "7b": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16},
    "small": {"depth": 32, "hidden_size": 128, "intermediate_size": 256, "num_heads": 16},
    "smoke": {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2},
}
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "A100": 312.0, "A800": 312.0}


def build_config(
    name: str,
    layers: int | None = None,
    vision_depth: int | None = None,
    vocab: int | None = None,
    images: bool = False,
):
    """A ``Qwen2_5_VLConfig`` of the named size (transformers v5 layout: text and vision sub-configs),
    optionally with fewer decoder layers, vision blocks or vocabulary rows at the same widths;
    ``images``: the media token ids at the top of the (cut) vocabulary (:func:`random_batch`)."""
    from transformers import Qwen2_5_VLConfig

    text = dict(TEXT_CONFIGS[name])
    tie = text.pop("tie_word_embeddings")
    if layers:
        text["num_hidden_layers"] = layers
    if vocab:
        text["vocab_size"] = vocab
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    pairs = head_dim // 2  # M-RoPE sections (temporal, height, width): 1/4, 3/8, 3/8 of the rotary pairs
    temporal = pairs // 4
    height = (pairs - temporal) // 2
    text.update(
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": [temporal, height, pairs - temporal - height],
        },
        tie_word_embeddings=tie,
    )
    depth = vision_depth or VISION_CONFIGS[name]["depth"]
    vision = dict(
        VISION_CONFIGS[name],
        depth=depth,
        out_hidden_size=text["hidden_size"],
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        # every 8th block attends over the whole image, the others within windows
        fullatt_block_indexes=[index for index in range(depth) if index % 8 == 7] or [depth - 1],
        tokens_per_second=2,
    )
    top = text["vocab_size"]  # the media tokens inside a cut vocabulary (random tokens stay below)
    media = {
        "image_token_id": top - 1,
        "video_token_id": top - 2,
        "vision_start_token_id": top - 3,
        "vision_end_token_id": top - 4,
    }
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=tie, **(media if images else {})
    )


def forward_flops(text: dict, sequence_lengths: list[int], response_tokens: int) -> float:
    """Matmul FLOPs of one forward over packed sequences of ``sequence_lengths`` tokens, with the LM head
    applied to ``response_tokens`` positions (see module docstring)."""
    hidden, inter, layers = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    head_dim = hidden // text["num_attention_heads"]
    kv = text["num_key_value_heads"] * head_dim
    tokens = sum(sequence_lengths)
    projections = 2 * (hidden * hidden * 2 + hidden * kv * 2)  # q, o: h x h; k, v: h x kv
    mlp = 2 * 3 * hidden * inter  # gate, up, down
    attention = sum(2 * 2 * hidden * s * (s + 1) // 2 for s in sequence_lengths)  # QK^T and AV, causal
    head = 2 * hidden * text["vocab_size"] * response_tokens
    return layers * (tokens * (projections + mlp) + attention) + head


def update_flops(text: dict, sequence_lengths: list[int], response_tokens: int) -> float:
    """Forward + backward: 3 × forward (backward computes gradients of inputs and of weights)."""
    return 3 * forward_flops(text, sequence_lengths, response_tokens)


def peak_tflops(device_name: str, override: float | None) -> float | None:
    if override:
        return override
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS.items() if key in device_name), None)


IMAGE_GRID = (1, 4, 4)  # --images: one image of 4 x 4 patches (4 merged tokens) per row
PATCH_WIDTH = 3 * 2 * 14 * 14  # channels x temporal patch x patch^2 (Qwen2.5-VL's patch embedding)
SPECIAL_TOKENS = 8  # the top of the vocabulary: media tokens (build_config)


def random_batch(
    rows: int,
    prompt_length: int,
    response_length: int,
    vocab: int,
    seed: int = 0,
    images: bool = False,
    ragged: bool = False,
    varied: bool = False,
):
    """Random rows, every token valid; advantages random, old log-probs filled in later. ``images``:
    each prompt begins with an image (random pixels, :data:`IMAGE_GRID`) in its placeholder tokens.
    ``ragged``: row r's prompt left-padded by 2r and its response right-padded by 3r tokens (modulo
    half their lengths), as a rollout hands rows over. ``varied``: the prompts padded so too, the
    responses' lengths spread evenly from 1/8 of ``response_length`` to all of it, in a random row order
    (a rollout's spread, where micro-batches of so many rows hold uneven token counts)."""
    import torch

    from mmrl.protocol import DataProto

    generator = torch.Generator().manual_seed(seed)
    low = 16  # stay clear of the special tokens at the bottom of the vocabulary
    high = vocab - SPECIAL_TOKENS if images else vocab
    prompts = torch.randint(low, high, (rows, prompt_length), generator=generator)
    responses = torch.randint(low, high, (rows, response_length), generator=generator)
    response_mask = torch.ones(rows, response_length, dtype=torch.long)
    prompt_mask = torch.ones(rows, prompt_length, dtype=torch.long)
    if ragged or varied:
        for row in range(rows):
            prompt_mask[row, : 2 * row % (prompt_length // 2)] = 0
    if ragged and not varied:
        for row in range(rows):
            response_mask[row, response_length - 3 * row % (response_length // 2) :] = 0
    if varied:
        shortest = max(1, response_length // 8)
        spread = (
            torch.linspace(shortest, response_length, rows) if rows > 1 else torch.tensor([response_length])
        )
        lengths = spread.round().long()[torch.randperm(rows, generator=generator)]
        response_mask = (torch.arange(response_length)[None, :] < lengths[:, None]).long()
    token_types = torch.zeros(rows, prompt_length + response_length, dtype=torch.long)
    non_tensors = {}
    if images:
        t, h, w = IMAGE_GRID
        tokens = t * h * w // 4  # merged 2 x 2
        prompts[:, 0], prompts[:, tokens + 1] = vocab - 3, vocab - 4  # vision start / end
        prompts[:, 1 : tokens + 1] = vocab - 1
        token_types[:, 1 : tokens + 1] = 1
        pixels = [torch.randn(t * h * w, PATCH_WIDTH, generator=generator) for _ in range(rows)]
        grid = torch.tensor([IMAGE_GRID])
        non_tensors["multi_modal_inputs"] = [{"pixel_values": p, "image_grid_thw": grid} for p in pixels]
    tensors = {"mm_token_type_ids": token_types} if images else {}
    tensors.update(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
            "response_mask": response_mask,
            "advantages": torch.randn(rows, 1, generator=generator)
            .expand(rows, response_length)
            .contiguous(),
        }
    )
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors or None)


def _init_one_rank_group(backend: str) -> None:
    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    dist.init_process_group(backend, rank=0, world_size=1)


def torch_shims() -> list[str]:
    """What this torch lacks of the pinned one (mmrl/versions.py), stood in so that the bench still runs
    (a GPU image may carry an older torch than a job installs): one line per stand-in."""
    from torch.distributed.fsdp import FSDPModule

    if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        return []
    FSDPModule.set_reduce_scatter_unused_params = lambda self, enable, recurse=True: None  # torch < 2.13
    import torch

    return [
        f"torch {torch.__version__}: no FSDPModule.set_reduce_scatter_unused_params (2.13); a no-op stands "
        "in (one rank reduces nothing), a job needs torch 2.13 (mmrl/versions.py)"
    ]


def build_model(config, device):
    """Random fp32 weights from seed 0 on ``device``: both sides of a run start from the same model."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2_5_VLForConditionalGeneration._from_config(
            config, dtype=torch.float32, attn_implementation="sdpa"
        )


class MmrlSide:
    """mmrl's actor as the trainer builds it (prepare_for_training, apply_fsdp2, build_optimizer,
    PolicyActor); ``step_context`` wraps its optimizer step (clipping included)."""

    name = "mmrl"

    def __init__(
        self,
        config,
        device,
        compute_dtype,
        checkpointing: bool,
        response_length: int,
        max_tokens: int | None = None,
        packed_attention: str = "sdpa",
        compiled: bool = False,
        reduce_grads_once: bool = False,
        recomputed: int | None = None,
        keep_gathered: bool = False,
        hold_gathered: bool = False,
        compiled_head: bool = False,
    ):
        import torch
        import torch.distributed as dist

        from mmrl.config import ActorConfig, FSDPConfig
        from mmrl.models.compiled import compile_head, compile_layers
        from mmrl.models.prepare import prepare_for_training
        from mmrl.workers.actor import PolicyActor
        from mmrl.workers.fsdp_engine import apply_fsdp2, build_optimizer, enable_gradient_checkpointing

        model = build_model(config, device)
        self.params = sum(p.numel() for p in model.parameters())
        self.param_tensors = sum(1 for _ in model.parameters())
        prepare_for_training(  # as the trainer prepares the actor
            model, packing=True, score_tokens=True, packed_attention=packed_attention
        )
        if checkpointing:
            enable_gradient_checkpointing(model, recomputed)
        if compiled:
            compile_layers(model)
        if compiled_head:
            compile_head(model)
        mesh = dist.device_mesh.init_device_mesh(device.type, (1,))
        model = apply_fsdp2(
            model,
            mesh,
            param_dtype=compute_dtype,
            reduce_dtype=torch.float32,
            reshard_after_forward=not keep_gathered,
        )
        optimizer = build_optimizer(model.parameters(), lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)
        self.actor = PolicyActor(
            model,
            ActorConfig(
                padding_free=True,
                max_tokens_per_micro_batch=max_tokens,
                reduce_grads_once=reduce_grads_once,
                keep_params_gathered=hold_gathered,
                fsdp=FSDPConfig(enable_full_shard=not keep_gathered),
            ),
            optimizer=optimizer,
            device=device,
            max_response_length=response_length,
        )
        self.step_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def prepare(self, batch):
        """``batch`` with its ``position_ids`` column, numbered once as the trainer numbers a rollout
        batch (``add_position_ids``); the original is left as it is."""
        from mmrl.workers.forward import add_position_ids

        return add_position_ids(self.actor.module, batch[:])

    def log_probs(self, batch, micro_batch: int):
        return self.actor.compute_log_probs(batch, micro_batch, temperature=1.0)[0]

    def update(self, batch, micro_batch: int) -> dict[str, float]:
        from mmrl.workers import fsdp_engine

        original = fsdp_engine.optimizer_step

        def optimizer_step(*args, **kwargs):
            with self.step_context():
                return original(*args, **kwargs)

        fsdp_engine.optimizer_step = optimizer_step  # train_on_batch looks it up at each call
        try:
            update = self.actor.update_policy(batch, len(batch), micro_batch, ppo_epochs=1, temperature=1.0)
        finally:
            fsdp_engine.optimizer_step = original
        return {"loss": update.metrics["pg_loss"], "grad_norm": update.metrics["grad_norm"]}


class PlainSide:
    """The plain FSDP2 loop: ``fully_shard`` per decoder layer and vision block and the root, the same
    mixed precision, fused AdamW, HF gradient checkpointing, ``logits_to_keep`` for the response tokens,
    a log-softmax gather, PPO's dual-clip loss (mmrl's default clip range) as a token mean, torch's
    ``clip_grad_norm_``."""

    name = "plain"
    CLIP_LOW, CLIP_HIGH, DUAL_CLIP = 0.2, 0.3, 3.0  # mmrl's PPO defaults (ActorConfig().clip_range)

    def __init__(
        self,
        config,
        device,
        compute_dtype,
        checkpointing: bool,
        response_length: int,
        ragged: bool = False,
        compiled: bool = False,
        recomputed: int | None = None,
        keep_gathered: bool = False,
        reduce_grads_once: bool = False,
        hold_gathered: bool = False,
        compiled_head: bool = False,
        **_,
    ):
        import torch
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = build_model(config, device)
        self.params = sum(p.numel() for p in model.parameters())
        self.param_tensors = sum(1 for _ in model.parameters())
        if compiled or compiled_head:
            raise ValueError("the plain loop compiles nothing")
        if reduce_grads_once:
            raise ValueError("the plain loop reduces its gradients in every micro-batch")
        if hold_gathered:
            raise ValueError("the plain loop reshards its parameters after every backward")
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
            if recomputed is not None:  # a user's two lines: only the first N layers recompute
                for layer in model.model.language_model.layers[recomputed:]:
                    layer.gradient_checkpointing = False
        mesh = dist.device_mesh.init_device_mesh(device.type, (1,))
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        shard = functools.partial(fully_shard, mesh=mesh, mp_policy=policy)
        for block in [*model.model.language_model.layers, *model.model.visual.blocks]:
            shard(block, reshard_after_forward=not keep_gathered)
        self.model = shard(model)
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0, fused=True
        )
        self.device, self.response_length = device, response_length
        self.ragged = ragged  # padded rows: the model gets their attention mask
        self.step_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def prepare(self, batch):
        return batch

    def _media(self, batch, rows) -> dict:
        """The rows' images joined, as a processor hands them to the model (none for text rows)."""
        import torch

        media = batch.non_tensor_batch.get("multi_modal_inputs")
        if media is None:
            return {}
        parts = list(media[rows])
        return {
            "pixel_values": torch.cat([part["pixel_values"] for part in parts]).to(self.device),
            "image_grid_thw": torch.cat([part["image_grid_thw"] for part in parts]).to(self.device),
            "mm_token_type_ids": batch.batch["mm_token_type_ids"][rows].to(self.device),
        }

    def _log_probs(self, input_ids, responses, media=None, attention_mask=None):
        """log p(response token) [b, R] in float32: the last R + 1 positions' logits, one gather."""
        import torch

        mask = {"attention_mask": attention_mask} if self.ragged else {}
        logits = self.model(
            input_ids=input_ids, logits_to_keep=self.response_length + 1, **mask, **(media or {})
        ).logits[:, :-1]
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)

    def log_probs(self, batch, micro_batch: int):
        import torch

        self.model.eval()
        tensors = batch.batch
        outputs = []
        with torch.no_grad():
            for start in range(0, len(batch), micro_batch):
                rows = slice(start, start + micro_batch)
                ids = tensors["input_ids"][rows].to(self.device)
                responses = tensors["responses"][rows].to(self.device)
                mask = tensors["attention_mask"][rows].to(self.device) if self.ragged else None
                outputs.append(self._log_probs(ids, responses, self._media(batch, rows), mask).cpu())
        for module in self.model.modules():  # no backward follows to free the root's gathered weights
            if hasattr(module, "reshard"):
                module.reshard()
        return torch.cat(outputs)

    def update(self, batch, micro_batch: int) -> dict[str, float]:
        import torch
        from torch.distributed.tensor import DTensor

        self.model.train()
        tensors = {key: value.to(self.device) for key, value in batch.batch.items()}
        mask = tensors["response_mask"].float()
        num_tokens = mask.sum()
        loss_sum = torch.zeros((), device=self.device)
        for start in range(0, len(batch), micro_batch):
            rows = slice(start, start + micro_batch)
            media = self._media(batch, rows)
            log_probs = self._log_probs(
                tensors["input_ids"][rows],
                tensors["responses"][rows],
                media,
                tensors["attention_mask"][rows] if self.ragged else None,
            )
            ratio = torch.exp(log_probs - tensors["old_log_probs"][rows])
            advantages = tensors["advantages"][rows]
            clipped = ratio.clamp(1 - self.CLIP_LOW, 1 + self.CLIP_HIGH)
            token_loss = torch.maximum(-advantages * ratio, -advantages * clipped)
            dual = torch.minimum(token_loss, -advantages * self.DUAL_CLIP)  # bounded for A < 0
            token_loss = torch.where(advantages < 0, dual, token_loss)
            loss = (token_loss * mask[rows]).sum() / num_tokens
            loss.backward()
            loss_sum += loss.detach()
        with self.step_context():
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        return {"loss": float(loss_sum), "grad_norm": float(grad_norm)}


SIDES = {"mmrl": MmrlSide, "plain": PlainSide}


def release() -> None:
    """Free the last side's model, gradients and optimizer states (its caller dropped it) before the
    next side is built."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ GPU: timings


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


TOP_OPS = 40  # ops (and kernels) listed per side, by device time, from the profiled update


# kernel kinds by name, first match wins (cuBLAS/CUTLASS products, attention, compiled, collectives...)
KERNEL_KINDS = (
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk")),
    ("attention", ("fmha", "flash", "sdpa", "attention", "cudnn")),
    ("compiled (triton)", ("triton",)),
    ("collective", ("nccl",)),
    ("optimizer", ("adam", "multi_tensor")),
    ("copy / cast / cat", ("copy", "memcpy", "cat", "memset", "fill")),
    ("reduction", ("reduce", "softmax", "norm")),
    ("elementwise", ("elementwise",)),
)


def kernel_kinds(kernels) -> dict[str, float]:
    """Device ms per kind of kernel (:data:`KERNEL_KINDS`, ``other`` for the rest) from ``(name,
    device us)`` pairs."""
    totals: dict[str, float] = {}
    for name, device_us in kernels:
        kind = kernel_kind(name)
        totals[kind] = totals.get(kind, 0.0) + device_us / 1e3
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def kernel_kind(name: str) -> str:
    """The :data:`KERNEL_KINDS` kind of the kernel ``name`` (``other`` when none matches)."""
    lowered = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(key in lowered for key in keys)), "other")


def host_and_kernel_seconds(side, batch, micro_batch: int, device) -> tuple[float | None, float | None]:
    """One update under the profiler: (host op time, device kernel time) in seconds, self times summed
    (each microsecond counted once). None on the CPU."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return None, None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        side.update(batch, micro_batch)
        torch.cuda.synchronize()
    from torch.autograd import DeviceType

    events = profiler.key_averages()
    host = sum(event.self_cpu_time_total for event in events)
    # kernels only: an op's own device time repeats the time of the kernels it launched
    kernel = sum(event.self_device_time_total for event in events if event.device_type == DeviceType.CUDA)
    side.kernel_kinds = kernel_kinds(
        (event.key, event.self_device_time_total or 0)
        for event in events
        if event.device_type == DeviceType.CUDA
    )
    side.product_kernels = {
        event.key: (event.count, (event.self_device_time_total or 0) / 1e3)
        for event in events
        if event.device_type == DeviceType.CUDA and kernel_kind(event.key) == "matmul"
    }
    top = sorted(events, key=lambda event: -(getattr(event, "self_device_time_total", 0) or 0))[:TOP_OPS]
    side.top_ops = [
        (event.key, event.count, (event.self_device_time_total or 0) / 1e3, event.self_cpu_time_total / 1e3)
        for event in top
    ]
    return host / 1e6, kernel / 1e6


class DeviceSampler:
    """The GPU's SM clock (MHz) and power draw (W), read every ``interval_s`` by a thread while the
    ``with`` block runs: whether a side's kernels ran at the clock another side's did (a GPU at its
    power limit lowers its clock, and every kernel takes longer). ``read`` returns one ``(MHz, W)``
    reading; None (no NVML) leaves both figures None."""

    def __init__(self, read: Callable[[], tuple[float, float]] | None, interval_s: float = 0.05):
        self.read, self.interval_s = read, interval_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(self.read())

    def __enter__(self) -> DeviceSampler:
        if self.read is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def clock_mhz(self) -> float | None:
        """The median SM clock over the block (None: nothing read)."""
        return statistics.median(mhz for mhz, _ in self.samples) if self.samples else None

    @property
    def power_w(self) -> float | None:
        """The mean power draw over the block (None: nothing read)."""
        return statistics.fmean(watts for _, watts in self.samples) if self.samples else None


def nvml_reader(device) -> Callable[[], tuple[float, float]] | None:
    """``device``'s ``(SM clock MHz, power W)`` through torch's NVML queries, or None on the CPU or
    where NVML is not at hand (torch reads it through ``pynvml``, the ``nvidia-ml-py`` package)."""
    import torch

    if device.type != "cuda":
        return None

    def read() -> tuple[float, float]:
        return float(torch.cuda.clock_rate(device)), torch.cuda.power_draw(device) / 1e3  # mW

    try:
        read()
    except Exception:  # no pynvml, or a driver without these queries
        return None
    return read


def measure_side(side, batch, args, device) -> dict:
    """Timed updates (median of ``--repeats`` after a warm-up), the optimizer step's seconds, the
    no-grad log-prob pass's seconds, peak memory and the host-bound share, of one side."""
    import torch

    step_seconds: list[float] = []

    @contextlib.contextmanager
    def timed_step() -> Iterator[None]:
        synchronize(device)
        begin = time.perf_counter()
        yield
        synchronize(device)
        step_seconds.append(time.perf_counter() - begin)

    def timed(call) -> tuple[float, object]:
        synchronize(device)
        begin = time.perf_counter()
        value = call()
        synchronize(device)
        return time.perf_counter() - begin, value

    metrics = side.update(batch, args.micro_batch)  # warm-up: allocator, kernels, optimizer states
    side.log_probs(batch, args.log_prob_micro_batch or args.micro_batch)  # and the no-grad pass's
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    side.step_context = timed_step
    update_s = []
    with DeviceSampler(nvml_reader(device)) as sampler:
        for _ in range(args.repeats):
            seconds, metrics = timed(lambda: side.update(batch, args.micro_batch))
            update_s.append(seconds)
    side.step_context = contextlib.nullcontext
    log_prob_s = timed(lambda: side.log_probs(batch, args.log_prob_micro_batch or args.micro_batch))[0]
    peak = torch.cuda.max_memory_allocated() / 1024**3 if device.type == "cuda" else None
    reserved = torch.cuda.max_memory_reserved() / 1024**3 if device.type == "cuda" else None
    free = torch.cuda.mem_get_info()[0] / 1024**3 if device.type == "cuda" else None
    host_s, kernel_s = (None, None)
    if args.profile:
        host_s, kernel_s = host_and_kernel_seconds(side, batch, args.micro_batch, device)
    return {
        "params": side.params,
        "update_s": statistics.median(update_s),
        "update_s_runs": update_s,
        "optimizer_step_s": statistics.median(step_seconds),
        "log_prob_s": log_prob_s,
        "peak_memory_gib": peak,
        "peak_reserved_gib": reserved,
        "device_free_gib": free,
        "host_s": host_s,
        "kernel_s": kernel_s,
        "host_per_kernel": host_s / kernel_s if host_s and kernel_s else None,
        "gpu_busy": min(1.0, kernel_s / statistics.median(update_s)) if kernel_s else None,
        "sm_clock_mhz": sampler.clock_mhz,
        "power_w": sampler.power_w,
        "top_ops": getattr(side, "top_ops", []),
        "kernel_kinds": getattr(side, "kernel_kinds", {}),
        "product_kernels": getattr(side, "product_kernels", {}),
        "metrics": metrics,
    }


def run(args: argparse.Namespace) -> dict:
    """The timed mode: mmrl's side (and the plain loop with ``baseline="plain"``) on the same model and
    batch. Returns mmrl's figures at the top level (``bench/gpu_check.py`` reads them) and each side's
    under ``sides``."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu" if args.smoke else "cuda")
    if not dist.is_initialized():  # bench/gpu_check.py runs this in its own one-rank group
        _init_one_rank_group("gloo" if args.smoke else "nccl")
    notes = torch_shims()
    kernel = attention_kernel(device, getattr(args, "attention", "sdpa"))
    config = build_config(args.model, layers=getattr(args, "layers", None))
    text = dict(TEXT_CONFIGS[args.model], num_hidden_layers=config.text_config.num_hidden_layers)
    compute_dtype = torch.float32 if args.smoke else torch.bfloat16
    batch = random_batch(
        args.rows,
        args.prompt_length,
        args.response_length,
        text["vocab_size"],
        ragged=getattr(args, "ragged", False),
        varied=getattr(args, "varied", False),
    )
    lengths = batch.batch["attention_mask"].sum(-1).tolist()  # valid tokens: padding is no work done
    tokens = sum(lengths)
    flops = update_flops(text, lengths, int(batch.batch["response_mask"].sum()))
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)"
    peak = peak_tflops(device_name, args.peak_tflops)
    sides = {}
    failed: dict[str, str] = {}
    for spec in side_specs(args):
        parse_side(spec)  # every spec checked before the first side is built
    for spec in side_specs(args):
        try:
            result, batch = time_side(spec, config, device, compute_dtype, batch, args)
        except Exception as error:  # one side's failure (a compile, memory) leaves the others timed
            traceback.print_exc()
            failed[spec] = f"{type(error).__name__}: {str(error)[:300]}"
            result = None
        if result is None:
            release()  # outside the handler: the traceback no longer holds the side's frames
            continue
        result.update(
            tokens_per_s=tokens / result["update_s"],
            log_prob_tokens_per_s=tokens / result["log_prob_s"],
            achieved_tflops=flops / result["update_s"] / 1e12,
            mfu=flops / result["update_s"] / (peak * 1e12) if peak else None,
        )
        sides[spec] = result
        print(f"  {spec}: {result['tokens_per_s']:.0f} tokens/s", flush=True)
    if not any(spec.startswith("mmrl") for spec in sides):  # the figures at the top level are mmrl's
        raise RuntimeError(f"no mmrl side ran: {failed}")
    first_mmrl = next(spec for spec in sides if spec.startswith("mmrl"))
    return {
        **sides[first_mmrl],
        "model": args.model,
        "device": device_name,
        "torch": torch.__version__,
        "notes": notes,
        "attention": kernel,
        "failed": failed,
        "tokens_per_update": tokens,
        "padded_tokens_per_update": args.rows * (args.prompt_length + args.response_length),
        "tflops_per_update": flops / 1e12,
        "peak_tflops": peak,
        "sides": sides,
    }


class Side(NamedTuple):
    """A ``--sides`` entry (:func:`parse_side`): the side's name and its settings."""

    name: str
    checkpointing: bool  # decoder layers (some or all) recompute their activations in the backward
    recomputed: int | None = None  # only the first N decoder layers do (None: every one)
    compiled: bool = False  # +compile
    head: bool = False  # +head: the log-prob head's chunk math compiled
    keep: bool = False  # +keep: each unit's gathered parameters kept from its forward to its backward
    hold: bool = False  # +hold: and from a micro-batch's backward to the next one's forward
    once: bool = False  # +once: one gradient reduction per optimizer step
    budget: bool = False  # +budget: micro-batches by token budget, not by row count


SIDE_OPTIONS = ("compile", "head", "keep", "hold", "once", "budget")


def parse_side(spec: str) -> Side:
    """``name:checkpointing[+option...]``, e.g. ``mmrl:full``, ``mmrl:off+compile``, ``mmrl:28+compile``,
    ``mmrl:full+compile+keep+once``, ``plain:full``: the side; whether its layers' activations are
    checkpointed (``full``: every layer's, recomputed in the backward; ``off``; a count N: the first N
    decoder layers', the trainer's ``gradient_checkpointing_layers``); its options (``compile``: the
    decoder layers compiled, ``compile_layers``; ``head``: ``compile_head``; ``keep``: FSDP's
    ``reshard_after_forward=False``, ``fsdp.enable_full_shard=false``; ``hold``:
    ``keep_params_gathered``; ``once``: ``reduce_grads_once``; ``budget``: micro-batches of at most
    ``--max_tokens`` packed tokens, ``max_tokens_per_micro_batch``)."""
    name, _, settings = spec.partition(":")
    checkpointing, *options = settings.split("+")
    if (
        name not in SIDES
        or not (checkpointing in ("off", "full") or checkpointing.isdigit())
        or not set(options) <= set(SIDE_OPTIONS)
        or len(set(options)) < len(options)
    ):
        raise SystemExit(
            f"--sides {spec!r}: name:checkpointing[+option...], name one of {', '.join(SIDES)}, "
            f"checkpointing off, full or a count of decoder layers, options {', '.join(SIDE_OPTIONS)}"
        )
    return Side(
        name,
        checkpointing != "off",
        int(checkpointing) if checkpointing.isdigit() else None,
        *(option in options for option in SIDE_OPTIONS),
    )


def side_specs(args: argparse.Namespace) -> list[str]:
    """``--sides``, or the sides ``--gradient_checkpointing`` and ``--baseline`` name (mmrl, by token
    budget with ``--max_tokens``, and the plain loop with ``--baseline plain``, both checkpointing whole
    layers or not at all)."""
    if getattr(args, "sides", None):
        return list(args.sides)
    setting = "full" if args.gradient_checkpointing else "off"
    plain = [f"plain:{setting}"] if getattr(args, "baseline", None) == "plain" else []
    budget = "+budget" if getattr(args, "max_tokens", None) else ""
    return [f"mmrl:{setting}{budget}", *plain]


def time_side(spec: str, config, device, compute_dtype, batch, args: argparse.Namespace):
    """Build the side ``spec`` names and measure it (:func:`measure_side`); the first side to run adds
    the batch's ``old_log_probs`` (its own, from the same weights as every side's). Returns the side's
    figures and the batch."""
    from mmrl.protocol import DataProto
    from mmrl.workers.fsdp_engine import micro_batch_rows

    settings = parse_side(spec)
    if settings.budget and settings.name != "mmrl":
        raise ValueError("the plain loop batches by row count")
    budget = token_budget(args) if settings.budget else None
    padded = {"ragged": padded_rows(args)} if settings.name == "plain" else {}
    start = time.perf_counter()
    side = SIDES[settings.name](
        config,
        device,
        compute_dtype,
        settings.checkpointing,
        args.response_length,
        max_tokens=budget,
        packed_attention=getattr(args, "attention", "sdpa"),
        compiled=settings.compiled,
        recomputed=settings.recomputed,
        keep_gathered=settings.keep,
        **padded,
        **mmrl_options(settings.name, args, settings.once, settings.hold, settings.head),
    )
    build_s = time.perf_counter() - start
    micro_batches = len(micro_batch_rows(batch.batch["attention_mask"], args.micro_batch, budget))
    if "old_log_probs" not in batch.batch.keys():
        old = side.log_probs(side.prepare(batch), args.micro_batch)
        batch = batch.union(DataProto.from_dict(tensors={"old_log_probs": old}))
    options = argparse.Namespace(**{**_defaults(), **vars(args)})
    options.profile = options.profile and (not options.profile_sides or spec in options.profile_sides)
    graphs = compiled_graphs()
    try:
        result = measure_side(side, side.prepare(batch), options, device)
    finally:
        del side
        release()
    result.update(build_s=build_s, compiled_graphs=compiled_graphs() - graphs, micro_batches=micro_batches)
    return result, batch


def token_budget(args: argparse.Namespace) -> int:
    """A ``+budget`` side's packed tokens per micro-batch: ``--max_tokens``, by default what a
    micro-batch of ``--micro_batch`` unpadded rows holds."""
    return getattr(args, "max_tokens", None) or args.micro_batch * (args.prompt_length + args.response_length)


def padded_rows(args: argparse.Namespace) -> bool:
    """Whether the batch's rows carry padding (``--ragged``, ``--varied``): the plain loop then passes
    the attention mask."""
    return bool(getattr(args, "ragged", False) or getattr(args, "varied", False))


def mmrl_options(
    name: str, args: argparse.Namespace, once: bool = False, hold: bool = False, head: bool = False
) -> dict:
    """Keyword arguments of mmrl's side only: ``--reduce_grads_once`` or a side's ``+once``
    (``worker.actor.reduce_grads_once``), ``+hold`` (``worker.actor.keep_params_gathered``), ``+head``
    (``worker.actor.model.compile_head``); the plain loop is handed those it was given, to refuse them."""
    options = {"reduce_grads_once": once, "hold_gathered": hold, "compiled_head": head}
    if name != "mmrl":
        return {key: value for key, value in options.items() if value}
    return {**options, "reduce_grads_once": once or getattr(args, "reduce_grads_once", False)}


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (recompilations included)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def attention_kernel(device, choice: str) -> str:
    """The kernel mmrl's packed attention runs here with ``--attention`` (the trainer's
    ``worker.actor.model.packed_attention``)."""
    import torch

    from mmrl.models import attention

    probe = torch.zeros(1, 1, 1, 8, device=device, dtype=torch.bfloat16)
    kernel = attention._varlen_kernel(probe, 0.0, choice == "torch_varlen")
    if kernel is None:
        return "sdpa per sequence"
    return "flash-attn varlen" if kernel is attention._flash_attn_varlen_func() else "torch varlen"


def _defaults() -> dict:
    """Options ``bench/gpu_check.py``'s namespace may lack."""
    return {
        "log_prob_micro_batch": None,
        "profile": True,
        "baseline": None,
        "attention": "auto",
        "max_tokens": None,
        "ragged": False,
        "varied": False,
        "sides": None,
        "profile_sides": None,
    }


def print_product_kernels(result: dict) -> None:
    """The profiled sides' matrix-product kernels by name: calls and device ms of each, side by side
    (which kernels the library picked for the same products differs between eager and compiled code)."""
    sides = {
        spec: side["product_kernels"] for spec, side in result["sides"].items() if side.get("product_kernels")
    }
    if not sides:
        return
    names = sorted(
        {name for kernels in sides.values() for name in kernels},
        key=lambda name: -max(kernels.get(name, (0, 0.0))[1] for kernels in sides.values()),
    )
    print("\nthe profiled updates' matrix-product kernels (calls, device ms)\n")
    print(f"| kernel | {' | '.join(sides)} |\n|---|{'---|' * len(sides)}")
    for name in names:
        cells = [kernels.get(name) for kernels in sides.values()]
        print(f"| {name[:100]} | {' | '.join('-' if c is None else f'{c[0]}, {c[1]:.1f}' for c in cells)} |")


def print_timings(args: argparse.Namespace, result: dict) -> None:
    setting = (
        "fp32 on the CPU (smoke check)"
        if args.smoke
        else "bf16 compute / fp32 master weights, FSDP2 on 1 GPU"
    )
    padding = (
        f" padded, {result['tokens_per_update']:,} valid ({'--varied' if args.varied else '--ragged'})"
        if padded_rows(args)
        else ""
    )
    budget = (
        f" (+budget sides: {token_budget(args):,} tokens)"
        if any("+budget" in spec for spec in result["sides"])
        else ""
    )
    print(
        f"\nactor update, {args.rows} rows x ({args.prompt_length} prompt + {args.response_length} response) "
        f"tokens{padding}, micro-batch {args.micro_batch}{budget}, {setting}, gradient "
        f"checkpointing per side (name:checkpointing[+option...]); mmrl's attention: "
        f"{result['attention']}; median of {args.repeats}; {result['device']}, torch {result['torch']}; "
        "tokens/s and MFU count valid tokens\n"
    )
    print(
        "| side | params | micro-batches | update s | tokens/s | TFLOP/s | MFU | peak GiB | optimizer step s "
        "| log-prob tokens/s | host s / kernel s | GPU busy | SM MHz | power W | loss | grad norm "
        "| graphs compiled |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, side in result["sides"].items():
        mfu = "-" if side["mfu"] is None else f"{side['mfu']:.1%}"
        memory = "-" if side["peak_memory_gib"] is None else f"{side['peak_memory_gib']:.1f}"
        host = (
            "-" if side["host_per_kernel"] is None
            else f"{side['host_s']:.2f} / {side['kernel_s']:.2f} ({side['host_per_kernel']:.2f})"
        )  # fmt: skip
        busy = "-" if side.get("gpu_busy") is None else f"{side['gpu_busy']:.0%}"
        clock = "-" if side.get("sm_clock_mhz") is None else f"{side['sm_clock_mhz']:.0f}"
        power = "-" if side.get("power_w") is None else f"{side['power_w']:.0f}"
        print(
            f"| {name} | {side['params'] / 1e9:.2f}B | {side['micro_batches']} | {side['update_s']:.3f} "
            f"| {side['tokens_per_s']:.0f} "
            f"| {side['achieved_tflops']:.1f} | {mfu} | {memory} | {side['optimizer_step_s']:.3f} "
            f"| {side['log_prob_tokens_per_s']:.0f} | {host} | {busy} | {clock} | {power} "
            f"| {side['metrics']['loss']:.6f} "
            f"| {side['metrics']['grad_norm']:.6f} | {side['compiled_graphs']} |"
        )
    kinds = {spec: side["kernel_kinds"] for spec, side in result["sides"].items() if side["kernel_kinds"]}
    if kinds:
        names = sorted(
            {kind for totals in kinds.values() for kind in totals},
            key=lambda kind: -max(totals.get(kind, 0.0) for totals in kinds.values()),
        )
        print("\nthe profiled updates' kernel time by kind (device ms)\n")
        print(f"| kind | {' | '.join(kinds)} |\n|---|{'---|' * len(kinds)}")
        for kind in names:
            print(f"| {kind} | {' | '.join(f'{totals.get(kind, 0.0):.1f}' for totals in kinds.values())} |")
        print(f"| all kernels | {' | '.join(f'{sum(totals.values()):.1f}' for totals in kinds.values())} |")
    print_product_kernels(result)
    for name, side in result["sides"].items():
        if side["top_ops"]:
            print(f"\n{name}: the profiled update's top ops by device time\n")
            print("| op or kernel | calls | device ms | host ms |\n|---|---|---|---|")
            for key, count, device_ms, host_ms in side["top_ops"]:
                print(f"| {key[:90]} | {count} | {device_ms:.1f} | {host_ms:.1f} |")
    plains = [spec for spec in result["sides"] if spec.startswith("plain")]
    if plains:
        print()
    for spec, side in result["sides"].items():
        if spec.startswith("mmrl") and plains:
            ratios = ", ".join(
                f"{side['tokens_per_s'] / result['sides'][plain]['tokens_per_s']:.2f}x {plain}"
                for plain in plains
            )
            print(f"{spec} tokens/s: {ratios}")
    for spec, error in result.get("failed", {}).items():
        print(f"{spec} failed: {error}")
    for note in result["notes"]:
        print(f"note: {note}")


# ------------------------------------------------------------------------------------ CPU: op counts

TRACKED = ("copy_", "_to_copy", "_local_scalar_dense")  # device/dtype copies and casts, host syncs
COLUMNS = ("ops", "copy_", "_to_copy", "_local_scalar_dense", "dtensor")


def op_counter():
    """A ``TorchDispatchMode`` counting every aten op dispatched below autograd, per phase (forward,
    backward, FSDP2's own copies and the optimizer; an op on a DTensor once, not its local ops)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.phase = "micro_batches"
            self.counts: dict[str, Counter] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts = self.counts.setdefault(self.phase, Counter())
            counts["ops"] += 1
            name = func.overloadpacket.__name__
            if name in TRACKED:
                counts[name] += 1
            if any(issubclass(kind, DTensor) for kind in types):
                counts["dtensor"] += 1
            return func(*args, **(kwargs or {}))

        @contextlib.contextmanager
        def in_phase(self, phase: str) -> Iterator[None]:
            previous, self.phase = self.phase, phase
            try:
                yield
            finally:
                self.phase = previous

    return OpCounter()


def counted(side, call: Callable, *args) -> dict[str, Counter]:
    """The ops of ``call(*args)`` (a method of ``side``) by phase: ``micro_batches`` (everything but the step) and ``optimizer``
    (gradient clipping and the optimizer step)."""
    counter = op_counter()
    side.step_context = lambda: counter.in_phase("optimizer")
    try:
        with counter:
            value = call(*args)
    finally:
        side.step_context = contextlib.nullcontext
    counts = {phase: counter.counts.get(phase, Counter()) for phase in ("micro_batches", "optimizer")}
    return counts, value


def count_side(name: str, args: argparse.Namespace, batch) -> dict:
    """One side's counts over its runs (see the module docstring): ``full`` (``--layers``, 2
    micro-batches), ``one_micro_batch`` (the same rows at once), ``half_rows`` (half the rows, 2
    micro-batches of half the size), ``one_layer``, and the log-prob pass with 2 and with 1
    micro-batch."""
    import torch

    device, rows = torch.device("cpu"), len(batch)
    counts: dict[str, dict] = {}
    for layers in (args.layers, 1):
        config = build_config(
            args.widths, layers=layers, vision_depth=args.vision_depth, vocab=args.vocab, images=args.images
        )
        ragged = {"ragged": padded_rows(args)} if name == "plain" else {}
        options = {**ragged, **mmrl_options(name, args)}
        side = SIDES[name](config, device, torch.bfloat16, True, args.response_length, **options)
        batch = side.prepare(batch)
        side.update(batch, rows // 2)  # warm-up: optimizer states exist from here on
        key = "full" if layers == args.layers else "one_layer"
        counts[key], metrics = counted(side, side.update, batch, rows // 2)
        if layers == args.layers:
            update_metrics = metrics  # the second update from the same weights on both sides
            counts["one_micro_batch"] = counted(side, side.update, batch, rows)[0]
            half = batch[list(range(rows // 2))]
            counts["half_rows"] = counted(side, side.update, half, rows // 4)[0]
            counts["log_probs"] = counted(side, side.log_probs, batch, rows // 2)[0]
            counts["log_probs_one"] = counted(side, side.log_probs, batch, rows)[0]
            param_tensors = side.param_tensors
        print(f"  {name}: {layers}-layer runs counted", flush=True)
        del side
        release()
    return {"param_tensors": param_tensors, "counts": counts, "metrics": update_metrics}


def per_unit(side: dict) -> dict[str, dict[str, float]]:
    """The table's rows for one side: each a {column: count} (see :func:`print_op_counts`)."""
    counts = side["counts"]

    def phase(run: str, which: str) -> Counter:
        return counts[run][which]

    def combine(*terms: tuple[float, Counter]) -> dict[str, float]:
        return {column: sum(weight * counter[column] for weight, counter in terms) for column in COLUMNS}

    full_mb, full_opt = phase("full", "micro_batches"), phase("full", "optimizer")
    return {
        "update (2 micro-batches)": combine((1, full_mb), (1, full_opt)),
        "micro-batch loop": combine((1, full_mb)),
        "optimizer step + clipping": combine((1, full_opt)),
        # 2 micro-batches of half the rows - 1 micro-batch of all: what one more micro-batch costs
        "per micro-batch": combine((1, full_mb), (-1, phase("one_micro_batch", "micro_batches"))),
        # (L layers - 1 layer) / (L - 1), per micro-batch: forward and backward of one decoder layer
        "per decoder layer, per micro-batch": combine(
            (0.5 / max(1, side["layers"] - 1), full_mb),
            (-0.5 / max(1, side["layers"] - 1), phase("one_layer", "micro_batches")),
        ),
        # all rows in 2 micro-batches - half the rows in 2: per row of a micro-batch
        "per extra row in a micro-batch": combine(
            (1 / side["rows"], full_mb), (-1 / side["rows"], phase("half_rows", "micro_batches"))
        ),
        "per parameter tensor, optimizer + clipping": combine((1 / side["param_tensors"], full_opt)),
        "log-prob pass (no grad, 2 micro-batches)": combine((1, phase("log_probs", "micro_batches"))),
        "log-prob pass, per micro-batch": combine(
            (1, phase("log_probs", "micro_batches")), (-1, phase("log_probs_one", "micro_batches"))
        ),
    }


def op_counts(args: argparse.Namespace) -> dict:
    """The CPU mode: both sides counted on the same model and batch."""
    import torch
    import torch.distributed as dist

    from mmrl.protocol import DataProto

    if not dist.is_initialized():
        _init_one_rank_group("gloo")
    notes = torch_shims()
    batch = random_batch(
        args.rows,
        args.prompt_length,
        args.response_length,
        args.vocab,
        images=args.images,
        ragged=args.ragged,
        varied=args.varied,
    )
    # old log-probs: those of near-uniform logits (random weights), so that the ratio is near 1 and no
    # token is clipped (a clipped token's gradient is zero); the same for both sides
    old = torch.full((args.rows, args.response_length), -math.log(args.vocab))
    batch = batch.union(DataProto.from_dict(tensors={"old_log_probs": old}))
    sides = {}
    for name in ("mmrl", "plain"):
        side = count_side(name, args, batch)
        side.update(layers=args.layers, rows=args.rows)
        side["table"] = per_unit(side)
        side["counts"] = {
            run: {which: dict(counter) for which, counter in phases.items()}
            for run, phases in side["counts"].items()
        }
        sides[name] = side
    return {"torch": torch.__version__, "notes": notes, "sides": sides}


def print_op_counts(args: argparse.Namespace, result: dict) -> None:
    padding = f", padded (--{'varied' if args.varied else 'ragged'})" if padded_rows(args) else ""
    print(
        f"\naten ops dispatched, Qwen2.5-VL-3B layout at {args.widths} widths, {args.layers} decoder layers, {args.vision_depth} "
        f"vision blocks, vocabulary {args.vocab:,}; {args.rows} rows x ({args.prompt_length} prompt + "
        f"{args.response_length} response) tokens{', an image of 4 x 4 patches each' if args.images else ''}"
        f"{padding}; bf16 compute / fp32 master, FSDP2 on 1 CPU rank "
        f"(gloo), gradient checkpointing on; torch {result['torch']}\n"
    )
    mmrl, plain = result["sides"]["mmrl"]["table"], result["sides"]["plain"]["table"]
    print(
        "| what | ops mmrl | ops plain | copy_ mmrl | copy_ plain | _to_copy mmrl | _to_copy plain "
        "| syncs mmrl | syncs plain | DTensor mmrl | DTensor plain |"
    )
    print("|---|" + "---|" * 10)

    def fmt(value: float) -> str:
        return f"{value:,.0f}" if float(value).is_integer() or abs(value) >= 100 else f"{value:,.2f}"

    for what in mmrl:
        cells = [f"{fmt(mmrl[what][column])} | {fmt(plain[what][column])}" for column in COLUMNS]
        print(f"| {what} | " + " | ".join(cells) + " |")
    numbers = {name: side["metrics"] for name, side in result["sides"].items()}
    print(
        "\nthe counted update's loss and gradient norm (same weights and batch, bf16): "
        + ", ".join(f"{name} {m['loss']:.6f} / {m['grad_norm']:.6f}" for name, m in numbers.items())
    )
    for note in result["notes"]:
        print(f"note: {note}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="3b", choices=["3b", "7b"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if present")
    parser.add_argument("--baseline", choices=["plain"], default=None, help="also time the plain FSDP2 loop")
    parser.add_argument("--rows", type=int, default=None, help="default 16 (GPU), 4 (CPU)")
    parser.add_argument("--prompt_length", type=int, default=None, help="default 512 (GPU), 16 (CPU)")
    parser.add_argument("--response_length", type=int, default=None, help="default 512 (GPU), 16 (CPU)")
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--log_prob_micro_batch", type=int, default=None, help="default: --micro_batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gradient_checkpointing", action="store_true", help="both sides: whole layers")
    parser.add_argument(
        "--sides",
        type=lambda text: text.split(","),
        default=None,
        help="GPU: sides to time in one run, e.g. mmrl:full,mmrl:full+compile,plain:full (name:off|full"
        "[+compile]); default mmrl (and plain) at --gradient_checkpointing",
    )
    parser.add_argument(
        "--profile_sides",
        type=lambda text: text.split(","),
        default=None,
        help="GPU: profile only these sides' update (default: every side's)",
    )
    parser.add_argument(
        "--attention",
        choices=["sdpa", "torch_varlen"],
        default="sdpa",
        help="mmrl's packed attention without flash-attn (worker.actor.model.packed_attention)",
    )
    parser.add_argument(
        "--max_tokens",
        type=int,
        default=None,
        help="the token budget of mmrl's +budget sides (max_tokens_per_micro_batch; default --micro_batch "
        "unpadded rows' tokens); without --sides, mmrl's side runs by it",
    )
    parser.add_argument(
        "--reduce_grads_once",
        action="store_true",
        help="mmrl: gradients reduced once per optimizer step, not per micro-batch (reduce_grads_once)",
    )
    parser.add_argument("--no_profile", dest="profile", action="store_false", help="skip the profiled update")
    parser.add_argument("--peak_tflops", type=float, default=None, help="peak dense bf16 TFLOP/s of the GPU")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (CPU mode: default 2)")
    parser.add_argument(
        "--widths",
        choices=["3b", "small", "smoke"],
        default="3b",
        help="CPU mode: 3B widths, or narrow ones (fast)",
    )
    parser.add_argument("--vision_depth", type=int, default=2, help="CPU mode: vision blocks")
    parser.add_argument("--vocab", type=int, default=8192, help="CPU mode: vocabulary rows")
    parser.add_argument(
        "--images", action="store_true", help="CPU mode: each prompt begins with an image of 4 x 4 patches"
    )
    parser.add_argument(
        "--ragged",
        action="store_true",
        help="text rows: left-padded prompts and right-padded responses of uneven lengths",
    )
    parser.add_argument(
        "--varied",
        action="store_true",
        help="text rows padded as --ragged, the responses 1/8 to all of --response_length long (a rollout's spread)",
    )
    parser.add_argument("--out", type=Path, default=None, help="the JSON file (default bench/results/...)")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny config on the CPU: checks the timed code path only"
    )
    args = parser.parse_args()

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.model, args.rows, args.prompt_length, args.response_length, args.repeats = "smoke", 4, 16, 16, 1
        args.micro_batch = min(args.micro_batch, 2)
    elif device == "cpu":
        if (args.ragged or args.varied) and args.images:
            parser.error("--ragged and --varied pad text rows only; leave out --images")
        if args.sides or args.profile_sides:
            parser.error(
                "--sides and --profile_sides time sides on a GPU (or with --smoke); the CPU mode counts both"
            )
        args.layers = args.layers or 2
        args.rows, args.prompt_length, args.response_length = (
            args.rows or 4,
            args.prompt_length or 16,
            args.response_length or 16,
        )
        if args.rows % 4:
            parser.error("--rows: the CPU mode halves the rows twice; give a multiple of 4")
        result = op_counts(args)
        print_op_counts(args, result)
        write(args, result, "gpu_mfu_ops.json")
    elif not torch.cuda.is_available():
        print(
            f"bench/gpu_mfu.py --device cuda needs a CUDA GPU, and this machine has none (torch "
            f"{torch.__version__}, CUDA build: {torch.version.cuda}). Nothing measured; "
            "`python bench/gpu_mfu.py --device cpu` counts the ops on the CPU."
        )
        sys.exit(0)
    args.rows, args.prompt_length, args.response_length = (
        args.rows or 16,
        args.prompt_length or 512,
        args.response_length or 512,
    )
    result = run(args)
    print_timings(args, result)
    write(args, result, "gpu_mfu_smoke.json" if args.smoke else "gpu_mfu.json")


def write(args: argparse.Namespace, result: dict, name: str) -> None:
    out = args.out or RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "result": result}, indent=2, default=str) + "\n")
    print(f"\nwritten to {out}")
    os._exit(0)  # skip the process group's teardown


if __name__ == "__main__":
    main()
