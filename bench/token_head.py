"""The log-prob head's per-chunk math, eager against compiled (``worker.actor.model.compile_head``).

    python bench/token_head.py [--tokens 1024] [--vocab 151936] [--repeats 5] [--device cpu|cuda]

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
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from harness import markdown_table, write_json

MiB = 1024**2


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


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

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    ]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="rows of one chunk (log_prob_chunk_tokens)")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if present")
    parser.add_argument(
        "--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda, fp32 on cpu"
    )
    parser.add_argument("--out", type=Path, default=None, help="the JSON file (default bench/results/...)")
    args = parser.parse_args()

    result = run(args)
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
    payload = {"args": {key: value for key, value in vars(args).items() if key != "out"}, "result": result}
    out = write_json("token_head.json", payload, args.out)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
