"""The log-prob head's per-chunk math, eager against compiled (``worker.actor.model.compile_head``);
with ``--whole``, the whole head against a plain one and Liger's fused linear cross-entropy.

    python bench/token_head.py [--tokens 1024] [--vocab 151936] [--repeats 5] [--device cpu|cuda]
    python bench/token_head.py --whole [--tokens 4096] [--width 2048] [--chunk_tokens 1024] ...

The head (``mmrl.models.token_scoring``) multiplies each chunk of ``--tokens`` response positions by
the output weight, then runs its chunk math on the ``[tokens, vocab]`` logits: in the forward the
log-prob of each target, the log-sum-exp and the entropy (:func:`_chunk_scores`); in the backward the
gradient wrt the logits (:func:`_chunk_logits_grad`), for a log-prob loss alone and with an entropy
bonus. This times that math alone on random logits (scale 3, the released vocabulary by default; the
matrix products around it are the same either way and left out): eager ops against the same
functions compiled by inductor (after a warm-up that compiles). Logits in ``--dtype``: by default bf16
on a GPU (the actor's compute dtype there), fp32 on the CPU (mmrl's compute dtype there); the math
itself runs in fp32 either way. Median seconds of ``--repeats`` calls, each on a fresh
copy of the logits (the math works in place on them; the copy is not timed), the compiled results'
largest difference from the eager ones, and on a GPU the peak memory each call allocates above its
inputs. ``bench/results/token_head.json`` keeps them.

``--whole`` times the whole head, forward and backward, on ``--tokens`` hidden rows of ``--width``
(one micro-batch's response tokens: 8 rows of 512, 4,096, by default) and an output weight ``[vocab, width]``,
the loss ``sum(g * log p(y))`` with random per-token weights ``g`` (what a policy loss hands the head):
the plain loop's head (the whole ``[tokens, vocab]`` logits, an fp32 log-softmax, a gather), mmrl's
chunked head (``mmrl.models.token_scoring.chunked_token_scores``, ``--chunk_tokens`` rows a chunk; it
computes each token's entropy too) with its chunk math eager and compiled, and, on a GPU where
``liger_kernel`` imports, Liger's ``LigerFusedLinearCrossEntropyLoss`` (``reduction="none"``: its
per-token loss is ``-log p(y)``, its gradient deferred to the backward; no entropy) at its own chunk
size (its logits bounded by the input's size: 64 rows a chunk at the 3B width and vocabulary) and at
about ``--chunk_tokens`` rows a chunk. Liger, as configured here by default, sums the weight's gradient
over its chunks in bf16 and casts each token's upstream gradient to bf16 (mmrl's head sums in the
weight's dtype over its fewer chunks): its gradient differences measure that too. Median seconds of each direction, the peak memory above
the inputs on a GPU, and the largest difference of the log-probs and both gradients from the plain
head's, relative to the largest value. ``bench/results/token_head_whole.json`` keeps them.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

from harness import markdown_table, write_json

MiB = 1024**2


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _device_and_dtype(args: argparse.Namespace):
    """``--device`` (cuda where present) and ``--dtype`` (bf16 on cuda, fp32 on the CPU) as torch's."""
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return device, {"bf16": torch.bfloat16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    ]


def _calls(logits, targets, temperature: float, entropy_bonus: bool) -> dict:
    """The chunk math's two calls on ``logits`` (each given a fresh copy by :func:`_timed`)."""
    import torch

    generator = torch.Generator(device=logits.device).manual_seed(1)
    rows = logits.shape[0]
    grad_log_probs = torch.randn(rows, generator=generator, device=logits.device)
    grad_entropies = torch.randn(rows, generator=generator, device=logits.device) if entropy_bonus else None
    z = logits.float() / temperature  # what the forward saved for the backward: lse and entropy per row
    lses, entropies = torch.logsumexp(z, dim=-1), -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    del z
    return {
        "scores": lambda math, fresh: math.scores(fresh, targets, temperature, None, None),
        "logit gradient": lambda math, fresh: math.logits_grad(
            fresh,
            lses,
            targets,
            grad_log_probs,
            grad_entropies,
            entropies,
            temperature,
            None,
            None,
            False,
        ),
    }


def _timed(call, math, logits, repeats: int, device) -> tuple[float, object, float | None]:
    """Median seconds of ``repeats`` calls after a warm-up, the last result, the peak MiB above the inputs."""
    import torch

    call(math, logits.clone())  # warm-up: compiles
    seconds, peak = [], None
    for _ in range(repeats):
        fresh = logits.clone()
        _synchronize(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        started = time.perf_counter()
        result = call(math, fresh)
        _synchronize(device)
        seconds.append(time.perf_counter() - started)
        if device.type == "cuda":
            peak = (torch.cuda.max_memory_allocated() - base) / MiB
        del fresh
    return statistics.median(seconds), result, peak


def _largest_difference(result, reference) -> float:
    import torch

    pairs = zip(result, reference) if isinstance(result, tuple) else [(result, reference)]
    return max(
        float((a.float() - b.float()).abs().max())
        for a, b in pairs
        if isinstance(a, torch.Tensor) and a.numel()
    )


def run(args: argparse.Namespace) -> dict:
    import torch

    from mmrl.models.compiled import compiled_chunk_math
    from mmrl.models.token_scoring import EAGER_CHUNK_MATH

    device, dtype = _device_and_dtype(args)
    generator = torch.Generator(device=device).manual_seed(0)
    logits = (3 * torch.randn(args.tokens, args.vocab, generator=generator, device=device)).to(dtype)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=generator, device=device)
    maths = {"eager": EAGER_CHUNK_MATH, "compiled": compiled_chunk_math("inductor")}
    rows = []
    for entropy_bonus in (False, True):
        for name, call in _calls(logits, targets, args.temperature, entropy_bonus).items():
            if name == "scores" and entropy_bonus:
                continue  # the forward does not depend on the loss
            label = f"{name}{' (entropy bonus)' if entropy_bonus else ''}"
            timings = {kind: _timed(call, math, logits, args.repeats, device) for kind, math in maths.items()}
            rows.append(
                {
                    "call": label,
                    "eager_s": timings["eager"][0],
                    "compiled_s": timings["compiled"][0],
                    "eager_peak_mib": timings["eager"][2],
                    "compiled_peak_mib": timings["compiled"][2],
                    "largest_difference": _largest_difference(timings["compiled"][1], timings["eager"][1]),
                }
            )
    return {"device": str(device), "dtype": str(dtype), "torch": torch.__version__, "rows": rows}


def _liger_chunk_rows(rows: int, width: int, vocab: int, chunk_mem_const: int) -> int:
    """The rows of each chunk Liger's fused linear cross-entropy (0.8.5) takes for ``rows`` x ``width``
    hidden rows and a ``vocab``-row weight: its ``[chunk, vocab]`` logits bounded by ``chunk_mem_const``
    x ``rows`` x ``width`` elements, the chunk a power of two."""
    pieces = math.ceil(vocab / (chunk_mem_const * width))
    return min(2 ** math.ceil(math.log2(math.ceil(rows / pieces))), rows)


def _liger_heads(device, temperature: float, args: argparse.Namespace) -> tuple[dict, dict]:
    """Liger's fused linear cross-entropy as log-prob heads (:func:`_heads`' layout), at its own chunk
    size and, where that differs, at about ``--chunk_tokens`` rows a chunk (its ``chunk_mem_const``,
    which only the function takes); or none, and why not."""
    if device.type != "cuda":
        return {}, {"liger": "Liger's kernels are Triton's: a GPU only"}
    try:
        from importlib.metadata import version

        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except Exception as error:  # not installed, or built for another torch or Triton
        return {}, {"liger": f"liger_kernel does not import ({type(error).__name__}: {error})"}
    loss = LigerFusedLinearCrossEntropyLoss(reduction="none")  # per token: -log p(y), deferred gradients

    def scaled(hidden):
        return hidden if temperature == 1.0 else hidden / temperature

    def default(hidden, weight, targets):
        return -loss(weight, scaled(hidden), targets)

    matched = max(1, math.ceil(args.vocab * args.chunk_tokens / (args.width * args.tokens)))

    def larger_chunks(hidden, weight, targets):
        options = {  # the Function's arguments after input, weight and target, in 0.8.5's order
            "bias": None,
            "ce_weight": None,
            "ignore_index": -100,
            "lse_square_scale": 0.0,
            "label_smoothing": 0.0,
            "reduction": "none",
            "softcap": None,
            "return_z_loss": False,
            "accum_dtype": None,
            "use_token_scaling": False,
            "return_token_accuracy": False,
            "return_predicted_tokens": False,
            "ce_impl": None,
            "ce_mode": None,
            "chunk_mem_const": matched,
        }
        apply = LigerFusedLinearCrossEntropyFunction.apply  # positional only (autograd.Function)
        return -apply(scaled(hidden), weight, targets, *options.values())[0]

    name = f"liger {version('liger-kernel')}"
    rows = {const: _liger_chunk_rows(args.tokens, args.width, args.vocab, const) for const in (1, matched)}
    heads = {name: (False, rows[1], default)}
    if rows[matched] != rows[1]:
        heads[f"{name}, larger chunks"] = (False, rows[matched], larger_chunks)
    return heads, {}


def _heads(device, temperature: float, args: argparse.Namespace) -> tuple[dict, dict]:
    """The heads timed by ``--whole``, name -> (computes entropies, rows a chunk, ``head(hidden, weight,
    targets)`` -> fp32 log-probs [N]), and the heads left out, name -> why."""
    import torch
    from torch.nn import functional as F

    from mmrl.models.compiled import compiled_chunk_math
    from mmrl.models.token_scoring import EAGER_CHUNK_MATH, TokenScoring, chunked_token_scores

    def plain(hidden, weight, targets):  # the plain loop's: divided only by a temperature it has
        logits = F.linear(hidden, weight).float()
        logits = logits if temperature == 1.0 else logits / temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)

    def chunked(chunk_math):
        def head(hidden, weight, targets):
            scoring = TokenScoring(targets, temperature, args.chunk_tokens)
            return chunked_token_scores(hidden, weight, None, scoring, chunk_math)[0]

        return head

    chunk = min(args.chunk_tokens, args.tokens)
    heads = {
        "plain": (False, args.tokens, plain),
        "mmrl": (True, chunk, chunked(EAGER_CHUNK_MATH)),
        "mmrl compiled": (True, chunk, chunked(compiled_chunk_math("inductor"))),
    }
    liger, left_out = _liger_heads(device, temperature, args)
    return heads | liger, left_out


def _timed_head(head, hidden, weight, targets, weights, repeats: int, device) -> dict:
    """Median forward and backward seconds of ``head`` under the loss ``sum(weights * log p)`` after a
    warm-up, the peak MiB above the inputs (GPU) and the last call's log-probs and gradients."""
    import torch

    forward_s, backward_s, peak = [], [], None
    for repeat in range(repeats + 1):  # the first call warms up (and compiles)
        hidden.grad = weight.grad = None
        _synchronize(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        started = time.perf_counter()
        log_probs = head(hidden, weight, targets)
        _synchronize(device)
        middle = time.perf_counter()
        (weights * log_probs).sum().backward()
        _synchronize(device)
        if repeat:
            forward_s.append(middle - started)
            backward_s.append(time.perf_counter() - middle)
        if device.type == "cuda":
            peak = (torch.cuda.max_memory_allocated() - base) / MiB
    return {
        "forward_s": statistics.median(forward_s),
        "backward_s": statistics.median(backward_s),
        "peak_mib": peak,
        "outputs": (log_probs.detach().float(), hidden.grad.float(), weight.grad.float()),
    }


def _relative_difference(result, reference) -> float:
    import torch

    return float((result - reference).abs().max() / reference.abs().max().clamp_min(torch.finfo().tiny))


def run_whole(args: argparse.Namespace) -> dict:
    """The whole head, each of :func:`_heads`, on the same hidden rows, weight, targets and loss."""
    import torch

    device, dtype = _device_and_dtype(args)
    generator = torch.Generator(device=device).manual_seed(0)

    def normal(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=generator, device=device)).to(dtype)

    hidden = normal(args.tokens, args.width).requires_grad_()
    # logits of standard deviation ~3, as the chunk math's bench draws them
    weight = normal(args.vocab, args.width, scale=3 / args.width**0.5).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=generator, device=device)
    weights = torch.randn(args.tokens, generator=generator, device=device)
    heads, left_out = _heads(device, args.temperature, args)
    timings = {}
    for name, (_, _, head) in heads.items():
        try:
            timings[name] = _timed_head(head, hidden, weight, targets, weights, args.repeats, device)
        except Exception as error:  # reported; the other heads still run (the plain one is the reference)
            if name == "plain":
                raise
            left_out[name] = f"failed: {type(error).__name__}: {error}"
    reference = timings["plain"]["outputs"]
    rows = []
    for name, timing in timings.items():
        entropies, chunk_rows, _ = heads[name]
        differences = [_relative_difference(a, b) for a, b in zip(timing["outputs"], reference)]
        rows.append(
            {
                "head": name,
                "entropies": entropies,
                "chunk_rows": chunk_rows,
                "forward_s": timing["forward_s"],
                "backward_s": timing["backward_s"],
                "peak_mib": timing["peak_mib"],
                "log_prob_difference": differences[0],
                "hidden_grad_difference": differences[1],
                "weight_grad_difference": differences[2],
            }
        )
    result = {"device": str(device), "dtype": str(dtype), "torch": torch.__version__, "rows": rows}
    return result | {"left_out": left_out}


def _print_whole(args: argparse.Namespace, result: dict) -> None:
    print(
        f"the whole log-prob head on {args.tokens:,} rows of {args.width:,}, vocabulary {args.vocab:,} "
        f"({result['dtype']}, {result['device']}, torch {result['torch']}), median of {args.repeats}; "
        "differences relative to the plain head's largest value\n"
    )
    gpu = result["device"].startswith("cuda")
    plain = next(row for row in result["rows"] if row["head"] == "plain")
    headers = ["head", "entropies", "rows a chunk", "forward s", "backward s", "both / plain's"]
    headers += ["peak MiB"] * gpu + [
        "log-prob difference",
        "hidden grad difference",
        "weight grad difference",
    ]
    table = []
    for row in result["rows"]:
        both = row["forward_s"] + row["backward_s"]
        cells = [
            row["head"],
            "yes" if row["entropies"] else "no",
            f"{row['chunk_rows']:,}",
            f"{row['forward_s']:.4f}",
            f"{row['backward_s']:.4f}",
            f"{both / (plain['forward_s'] + plain['backward_s']):.2f}",
        ]
        if gpu:
            cells.append(f"{row['peak_mib']:.0f}")
        cells += [
            f"{row[key]:.1e}"
            for key in ("log_prob_difference", "hidden_grad_difference", "weight_grad_difference")
        ]
        table.append(cells)
    print(markdown_table(headers, table))
    for name, why in result["left_out"].items():
        print(f"\nleft out: {name}: {why}")


def _print_math(args: argparse.Namespace, result: dict) -> None:
    print(
        f"the log-prob head's chunk math on [{args.tokens:,}, {args.vocab:,}] logits ({result['dtype']}, "
        f"{result['device']}, torch {result['torch']}), median of {args.repeats}\n"
    )
    gpu = result["device"].startswith("cuda")
    headers = ["call", "eager s", "compiled s", "compiled / eager", "largest difference"]
    table = []
    for row in result["rows"]:
        cells = [
            row["call"],
            f"{row['eager_s']:.4f}",
            f"{row['compiled_s']:.4f}",
            f"{row['compiled_s'] / row['eager_s']:.2f}",
            f"{row['largest_difference']:.2e}",
        ]
        if gpu:
            cells += [f"{row['eager_peak_mib']:.0f}", f"{row['compiled_peak_mib']:.0f}"]
        table.append(cells)
    print(markdown_table(headers + (["eager peak MiB", "compiled peak MiB"] if gpu else []), table))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="rows: of one chunk (default 1,024), or with --whole of the head's input (default 4,096)",
    )
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--whole", action="store_true", help="the whole head against a plain one and Liger's")
    parser.add_argument("--width", type=int, default=2048, help="--whole: the hidden width (3B's: 2,048)")
    parser.add_argument("--chunk_tokens", type=int, default=1024, help="--whole: mmrl's rows per chunk")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls (>= 1) after a warm-up")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if present")
    parser.add_argument(
        "--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda, fp32 on cpu"
    )
    parser.add_argument("--out", type=Path, default=None, help="the JSON file (default bench/results/...)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats: at least 1")
    args.tokens = args.tokens or (4096 if args.whole else 1024)

    result = (run_whole if args.whole else run)(args)
    (_print_whole if args.whole else _print_math)(args, result)
    payload = {"args": {key: value for key, value in vars(args).items() if key != "out"}, "result": result}
    out = write_json("token_head_whole.json" if args.whole else "token_head.json", payload, args.out)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
