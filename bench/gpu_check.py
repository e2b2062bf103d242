"""One command for a GPU: the CUDA-only paths of mmrl, checked on one GPU in minutes (``make gpu-check``).

    python bench/gpu_check.py              # on a CUDA GPU: prints a table, exits 1 on any mismatch
    python bench/gpu_check.py --layers 8   # the update at the 3B widths with fewer layers (less memory)
    python bench/gpu_check.py --dry        # on the CPU at tiny sizes: checks this script's own plumbing

No Ray, no vLLM: one process, a one-rank process group (NCCL; gloo with ``--dry``). The checks:

- ``update``: one bf16 FSDP2 actor update of a random-weight Qwen2.5-VL at the 3B model's widths with the
  chunked log-prob head (``bench/gpu_mfu.py``: tokens/s, MFU, peak allocated and reserved memory,
  device memory left free); the update's loss and gradient norm must be finite.
- ``flash-attn``, ``torch varlen``: mmrl's packed attention with each varlen kernel present (flash-attn's,
  and torch's own ``torch.nn.attention.varlen``, which packed attention uses without flash-attn) against
  its own sdpa path, for whole packed rows and rows sharing a prompt (``mmrl.models.attention``), values
  and q/k/v gradients: each side's bf16 error against an fp32 computation, the kernel's no worse than
  twice sdpa's. ``--dry`` stands in a plain-torch kernel with flash-attn's documented semantics.
- ``ring``: ring attention (``mmrl.parallel.ring_attention``) on a ring of one: every block pair of
  the zigzag layout through the CUDA flash-attention op and its backward (bf16) against the CPU path
  (the CPU flash op, fp32; itself checked against sdpa), with torch's bf16 sdpa on the whole
  sequences as the yardstick of bf16 rounding.
- ``weight sync``: the full tensors the rollout receives (``iter_full_state_dict(..., dtype=bf16)``) of an
  FSDP2 model on the GPU equal its fp32 master weights cast to bf16, bit for bit.
- ``storage dtypes``: ``auto`` stores a trained model in fp32 and a frozen one in bf16 on CUDA, and FSDP2
  computes in bf16 (a linear layer sees bf16 weights in forward while its shard stays fp32).
- ``cuda rng``: ``capture_rng_state`` / ``restore_rng_state`` (checkpoints) replay the CUDA generator.
- ``memory figures``: a phase's peak allocated, reserved and device-free figures (``mmrl.workers.memory``).
- ``torch``: what the installed torch lacks of the pinned one (a GPU image's own older torch): a failed
  row, and a no-op stands in so that the other checks still run.

A check that raises is a failed row with the error. Writes ``bench/results/gpu_check.json`` (``--dry``:
``gpu_check_dry.json``). ``--dry`` also checks that its comparison flags a planted mismatch.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/gpu_mfu.py

RESULTS = Path(__file__).resolve().parent / "results"
FLASH_SLACK = 2.0  # flash-attn's error against fp32 may be this many times sdpa's own (bf16 rounding)
FLASH_FLOOR = 2e-3  # ... plus this (relative to the largest reference value)


@dataclass
class Row:
    check: str
    what: str
    result: str
    ok: bool


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """max |value - reference| / max |reference| (in fp32, on the CPU)."""
    value, reference = value.detach().float().cpu(), reference.detach().float().cpu()
    return float((value - reference).abs().max() / reference.abs().max().clamp_min(1e-12))


def no_worse(name: str, check: str, errors: tuple[float, float], labels: tuple[str, str]) -> Row:
    """A row: the first error is at most FLASH_SLACK x the second + FLASH_FLOOR."""
    tested, baseline = errors
    ok = math.isfinite(tested) and tested <= FLASH_SLACK * baseline + FLASH_FLOOR
    return Row(check, name, f"{labels[0]} {tested:.2e} vs {labels[1]} {baseline:.2e}", ok)


def within(check: str, name: str, error: float, tolerance: float) -> Row:
    return Row(check, name, f"{error:.2e} (<= {tolerance:.0e})", math.isfinite(error) and error <= tolerance)


# ---------------------------------------------------------------------------------------- update


def update_rows(device: torch.device, layers: int | None) -> list[Row]:
    import gpu_mfu

    dry = device.type == "cpu"
    args = argparse.Namespace(
        smoke=dry,
        model="smoke" if dry else "3b",
        layers=layers,
        rows=4 if dry else 8,
        prompt_length=16 if dry else 512,
        response_length=16 if dry else 512,
        micro_batch=2 if dry else 4,
        repeats=1 if dry else 2,
        gradient_checkpointing=not dry,
        peak_tflops=None,
    )
    result = gpu_mfu.run(args)
    finite = all(math.isfinite(value) for value in result["metrics"].values())
    shape = f"{args.rows} rows x {args.prompt_length}+{args.response_length} tokens, {result['params'] / 1e6:,.1f}M params"
    rows = [
        Row("update", f"bf16 FSDP2 actor update ({shape})", f"loss and grad norm finite: {finite}", finite)
    ]
    mfu = "-" if result["mfu"] is None else f"{result['mfu']:.1%}"
    speed = f"{result['tokens_per_s']:.0f} tok/s, MFU {mfu}, attention: {result['attention']}"
    rows.append(Row("update", "tokens/s, MFU", speed, True))
    if result["peak_memory_gib"] is not None:
        memory = (
            f"peak {result['peak_memory_gib']:.1f} GiB allocated, {result['peak_reserved_gib']:.1f} reserved, "
            f"{result['device_free_gib']:.1f} free"
        )
        rows.append(Row("update", "memory", memory, True))
    return rows


# ---------------------------------------------------------------------------------------- attention


def reference_flash_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal
):
    """``--dry`` only: flash-attn's documented varlen semantics in plain torch ([T, H, D], GQA, causal
    aligned to the bottom right of each segment)."""
    from mmrl.models.attention import bottom_right_causal_mask

    outputs = []
    for index in range(len(cu_seqlens_q) - 1):
        qs = q[cu_seqlens_q[index] : cu_seqlens_q[index + 1]].transpose(0, 1)
        ks = k[cu_seqlens_k[index] : cu_seqlens_k[index + 1]].transpose(0, 1)
        vs = v[cu_seqlens_k[index] : cu_seqlens_k[index + 1]].transpose(0, 1)
        ks, vs = (x.repeat_interleave(qs.shape[0] // ks.shape[0], 0) for x in (ks, vs))
        scores = (qs @ ks.transpose(-1, -2)) * softmax_scale
        mask = bottom_right_causal_mask(qs.shape[1], ks.shape[1], qs.device)
        outputs.append((scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(outputs)


@contextlib.contextmanager
def packed_attention_kernel(kernel: Callable | None) -> Iterator[None]:
    """mmrl's packed attention with the varlen ``kernel`` (flash-attn's calling convention; None: the
    sdpa path)."""
    from mmrl.models import attention

    saved = attention._varlen_kernel
    attention._varlen_kernel = lambda query, dropout, torch_varlen: kernel
    try:
        yield
    finally:
        attention._varlen_kernel = saved


def _attention_outputs(function, inputs, dtype, kernel, out_grad):
    """(out, dq, dk, dv) of ``function(q, k, v)`` on copies of ``inputs`` cast to ``dtype``."""
    leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
    with packed_attention_kernel(kernel):
        out = function(*leaves)
    (out.float() * out_grad).sum().backward()
    return [out, *(leaf.grad for leaf in leaves)]


def attention_rows(device: torch.device, flash: Callable, kernel_name: str) -> list[Row]:
    from mmrl.models import attention

    dry = device.type == "cpu"
    dtype = torch.bfloat16  # --dry too: the stand-in kernel and the sdpa path round alike on the CPU
    heads, kv_heads, dim = (4, 2, 16) if dry else (16, 2, 128)
    lengths = (13, 5, 22, 1) if dry else (300, 17, 1024, 5)
    tokens = sum(lengths)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, h, tokens, dim, generator=generator).to(device) for h in (heads, kv_heads, kv_heads)
    )
    out_grad = torch.randn(1, tokens, heads, dim, generator=generator).to(device)
    scale = dim**-0.5
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads  # what transformers' sdpa reads off an attention layer
    packed = attention.PackedSequences.from_lengths(lengths, device)
    prompt, responses = lengths[2], lengths[:2]  # one prompt, two responses: [prompt, r1, r2]
    segments = [(0, prompt, [(0, prompt)])]
    for start, length in zip((prompt, prompt + responses[0]), responses):
        segments.append((start, length, [(0, prompt), (start, length)]))
    shared = attention.SharedPrefixSequences.from_segments(segments, device)
    shared_tokens = prompt + sum(responses)
    cases = {
        "packed rows": (
            lambda a, b, c: attention.varlen_attention(module, a, b, c, packed, scale),
            (q, k, v),
        ),
        "shared prompt": (
            lambda a, b, c: attention.shared_prefix_attention(module, a, b, c, shared, scale),
            tuple(x[:, :, :shared_tokens] for x in (q, k, v)),
        ),
    }
    rows = []
    for name, (function, inputs) in cases.items():
        grad = out_grad[:, : inputs[0].shape[2]]
        reference = _attention_outputs(function, inputs, torch.float32, None, grad)
        sdpa = _attention_outputs(function, inputs, dtype, None, grad)
        tested = _attention_outputs(function, inputs, dtype, flash, grad)
        for label, ref, low, fast in zip(("out", "dq", "dk", "dv"), reference, sdpa, tested):
            errors = (relative_error(fast, ref), relative_error(low, ref))
            rows.append(no_worse(f"{name}: {label}", kernel_name, errors, ("varlen", "sdpa")))
    return rows


# ---------------------------------------------------------------------------------------- ring


def _ring_outputs(inputs, layout, device, dtype, out_grad):
    import torch.distributed as dist

    from mmrl.parallel.ring_attention import ring_attention

    leaves = [x.detach().to(device=device, dtype=dtype).requires_grad_() for x in inputs]
    out = ring_attention(
        *leaves, layout, 0, (dist.get_rank(),), dist.group.WORLD, inputs[0].shape[-1] ** -0.5
    )
    (out.float() * out_grad.to(device)).sum().backward()
    return [out, *(leaf.grad for leaf in leaves)]


def ring_rows(device: torch.device) -> list[Row]:
    """Ring attention on a ring of one rank: the zigzag layout's block pairs (a chunk on itself,
    causal; a later chunk on an earlier one, dense; query and key blocks of different lengths)."""
    from mmrl.parallel.sequence import ShardLayout

    dry = device.type == "cpu"
    heads, dim = (2, 16) if dry else (8, 128)
    lengths = (13, 6) if dry else (1000, 333)
    layout = ShardLayout(lengths, ring_size=1, ulysses_size=1)
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(heads, sum(lengths), dim, generator=generator) for _ in range(3)]
    out_grad = torch.randn(heads, sum(lengths), dim, generator=generator)
    labels = ("out", "dq", "dk", "dv")
    reference = _causal_outputs(inputs, lengths, torch.device("cpu"), torch.float32, out_grad)
    cpu = _ring_outputs(inputs, layout, torch.device("cpu"), torch.float32, out_grad)
    rows = [
        within("ring", f"CPU path (fp32): {label}", relative_error(value, ref), 1e-5)
        for label, value, ref in zip(labels, cpu, reference)
    ]
    # bf16 (--dry: the CPU op in bf16): the ring may err as much as torch's own bf16 attention, times 2
    low = _ring_outputs(inputs, layout, device, torch.bfloat16, out_grad)
    whole = _causal_outputs(inputs, lengths, device, torch.bfloat16, out_grad)
    kernels = "CPU flash op" if dry else "CUDA flash blocks"
    for label, value, expected, baseline in zip(labels, low, cpu, whole):
        errors = (relative_error(value, expected), relative_error(baseline, expected))
        rows.append(no_worse(f"{kernels} (bf16) vs CPU path: {label}", "ring", errors, ("ring", "sdpa bf16")))
    return rows


def _causal_outputs(inputs, lengths, device, dtype, out_grad):
    """(out, dq, dk, dv) of causal attention per sequence with torch's sdpa, not split into blocks."""
    leaves = [x.detach().to(device=device, dtype=dtype).requires_grad_() for x in inputs]
    parts = [
        torch.nn.functional.scaled_dot_product_attention(a[None], b[None], c[None], is_causal=True)[0]
        for a, b, c in zip(*(x.split(lengths, 1) for x in leaves))
    ]
    out = torch.cat(parts, 1)
    (out.float() * out_grad.to(device)).sum().backward()
    return [out, *(leaf.grad for leaf in leaves)]


# ---------------------------------------------------------------------------------------- the rest


def _small_fsdp_model(device: torch.device, param_dtype: torch.dtype):
    import gpu_mfu
    import torch.distributed as dist
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mmrl.workers.fsdp_engine import apply_fsdp2

    with device:
        model = Qwen2_5_VLForConditionalGeneration._from_config(
            gpu_mfu.build_config("smoke"), dtype=torch.float32
        )
    mesh = dist.device_mesh.init_device_mesh(device.type, (1,))
    return apply_fsdp2(model, mesh, param_dtype=param_dtype, reduce_dtype=torch.float32)


def weight_sync_rows(device: torch.device) -> list[Row]:
    from torch.distributed.tensor import DTensor

    from mmrl.workers.weight_sync import iter_full_state_dict

    model = _small_fsdp_model(device, torch.bfloat16)
    masters = {
        name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor)
        for name, tensor in model.state_dict().items()
    }
    sent = dict(iter_full_state_dict(model, device=device, dtype=torch.bfloat16))
    equal = [torch.equal(sent[name], masters[name].to(torch.bfloat16)) for name in sent]
    dtypes = {str(tensor.dtype) for tensor in sent.values()}
    return [Row("weight sync", f"{len(sent)} tensors cast to bf16 for the rollout", f"equal {sum(equal)}/{len(sent)}, dtypes {sorted(dtypes)}", all(equal) and dtypes == {"torch.bfloat16"})]  # fmt: skip


def storage_dtype_rows(device: torch.device) -> list[Row]:
    from mmrl.workers.fsdp_engine import resolve_dtype, storage_dtype

    low = torch.float32 if device.type == "cpu" else torch.bfloat16  # `auto` on this device
    rules = {
        "trained model stored (auto)": (storage_dtype("auto", device, trainable=True), torch.float32),
        "frozen reference stored (auto)": (storage_dtype("auto", device, trainable=False), low),
        "compute dtype (auto)": (resolve_dtype("auto", device), low),
    }
    rows = [Row("storage dtypes", name, str(got), got == want) for name, (got, want) in rules.items()]
    model = _small_fsdp_model(device, resolve_dtype("auto", device))
    seen = []
    layer = model.get_decoder().layers[0].mlp.gate_proj
    handle = layer.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]], device=device))
    handle.remove()
    shard = layer.weight.dtype
    rows.append(Row("storage dtypes", "FSDP2 forward weights / stored shard", f"{seen[0]} / {shard}", seen == [low] and shard == torch.float32))  # fmt: skip
    return rows


def rng_rows(device: torch.device) -> list[Row]:
    from mmrl.checkpoint.state import capture_rng_state, restore_rng_state

    state = capture_rng_state()
    first = torch.rand(1000, device=device)
    restore_rng_state(state)
    again = torch.rand(1000, device=device)
    kind = "CUDA" if device.type == "cuda" else "CPU"
    return [Row("cuda rng", f"{kind} generator replayed after restore", str(torch.equal(first, again)), torch.equal(first, again))]  # fmt: skip


def memory_rows(device: torch.device) -> list[Row]:
    from mmrl.workers.memory import PhasePeaks

    peaks = PhasePeaks(device)
    with peaks.phase("check"):
        block = torch.ones(256 * 1024 * 1024 // 4, device=device)  # 256 MiB
        del block
    taken = peaks.take()
    if device.type == "cpu":
        return [
            Row(
                "memory figures",
                "CPU: resident-set peak",
                f"{taken}",
                set(taken) == {"memory/check_peak_gib"},
            )
        ]
    peak, reserved, free = (taken[f"memory/check_{k}_gib"] for k in ("peak", "reserved_peak", "device_free"))
    ok = 0.24 < peak <= reserved and free > 0
    return [Row("memory figures", "peak allocated <= reserved; device free", f"{peak:.2f} / {reserved:.2f} / {free:.1f} GiB", ok)]  # fmt: skip


def planted_mismatch_rows() -> list[Row]:
    """``--dry``: the comparisons must fail on values that differ (else every row could pass by mistake)."""
    value = torch.ones(8)
    caught = not within("x", "x", relative_error(value + 0.1, value), 1e-5).ok
    caught &= not no_worse("x", "x", (0.5, 0.01), ("a", "b")).ok
    return [Row("self-check", "a planted mismatch is flagged", str(caught), caught)]


# ---------------------------------------------------------------------------------------- driver


def varlen_kernels(dry: bool, allow_missing: bool) -> tuple[dict[str, Callable], list[Row]]:
    """The varlen kernels packed attention can use here, by name: flash-attn's (its own install step)
    and torch's own (``torch.nn.attention.varlen``, torch >= 2.10)."""
    if dry:
        return {"flash-attn": reference_flash_varlen}, [
            Row("flash-attn", "kernel", "plain-torch stand-in (--dry)", True)
        ]
    from mmrl.models.attention import _flash_attn_varlen_func, _torch_varlen_func

    kernels, rows = {}, []
    flash = _flash_attn_varlen_func()
    if flash is None:
        note = "not installed or does not load (docs/gpu.md: its own install step)"
        rows.append(Row("flash-attn", "kernel", note + ("; allowed" if allow_missing else ""), allow_missing))
    else:
        import flash_attn

        kernels["flash-attn"] = flash
        rows.append(Row("flash-attn", "kernel", f"flash_attn {flash_attn.__version__}", True))
    torch_kernel = _torch_varlen_func()
    if torch_kernel is not None:
        kernels["torch varlen"] = torch_kernel
    rows.append(Row("torch varlen", "kernel", "present" if torch_kernel else f"absent in torch {torch.__version__}", True))  # fmt: skip
    return kernels, rows


def torch_shims() -> list[Row]:
    """Rows for what this torch lacks of the pinned one (``gpu_mfu.torch_shims``: stood in so that the
    other checks still run; a GPU image may carry an older torch than a job installs)."""
    import gpu_mfu

    return [Row("torch", note, "stood in for the checks below", False) for note in gpu_mfu.torch_shims()]


def run_checks(device: torch.device, args: argparse.Namespace) -> list[Row]:
    dry = device.type == "cpu"
    kernels, rows = varlen_kernels(dry, args.allow_missing_flash_attn)
    checks: list[tuple[str, Callable[[], list[Row]]]] = [
        ("update", lambda: update_rows(device, args.layers)),
        *(
            (name, functools.partial(attention_rows, device, kernel, name))
            for name, kernel in kernels.items()
        ),
        ("ring", lambda: ring_rows(device)),
        ("weight sync", lambda: weight_sync_rows(device)),
        ("storage dtypes", lambda: storage_dtype_rows(device)),
        ("cuda rng", lambda: rng_rows(device)),
        ("memory figures", lambda: memory_rows(device)),
    ]
    if dry:
        checks.append(("self-check", planted_mismatch_rows))
    for name, check in checks:
        try:
            rows.extend(check())
        except Exception as err:  # a check that crashes is a failed row, the others still run
            traceback.print_exc()
            rows.append(
                Row(
                    name,
                    "raised",
                    f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                    False,
                )
            )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| check | what | result | ok |", "|---|---|---|---|"]
    lines += [f"| {r.check} | {r.what} | {r.result} | {'ok' if r.ok else 'MISMATCH'} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dry", action="store_true", help="tiny sizes on the CPU: checks this script's plumbing"
    )
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of the update's model (default: the 3B's 36)")  # fmt: skip
    parser.add_argument("--allow_missing_flash_attn", action="store_true", help="no flash-attn is no failure")
    parser.add_argument(
        "--out", type=Path, default=None, help="the JSON file (default bench/results/gpu_check*.json)"
    )
    args = parser.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        print(f"bench/gpu_check.py needs a CUDA GPU (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
              "`--dry` runs its plumbing on the CPU.")  # fmt: skip
        return 2
    import gpu_mfu

    rows = torch_shims()
    device = torch.device("cpu") if args.dry else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    gpu_mfu._init_one_rank_group("gloo" if args.dry else "nccl")
    rows += run_checks(device, args)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (--dry: plumbing only)"
    print(f"\nmmrl gpu-check on {name}, torch {torch.__version__}\n\n{table(rows)}")
    failed = [row for row in rows if not row.ok]
    print(f"\n{len(rows) - len(failed)} ok, {len(failed)} mismatched")
    out = args.out or RESULTS / ("gpu_check_dry.json" if args.dry else "gpu_check.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": name, "rows": [asdict(row) for row in rows]}, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip the process group's teardown (gloo/NCCL threads at exit)
