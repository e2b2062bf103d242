"""Run a function on N local torch.distributed gloo ranks (spawned processes) and collect its results.

For tests and benchmarks that need real multi-process collectives without Ray (here in ``mmrl.demo``,
the top layer, because the ranks' preloaded modules include the workers').

Each rank runs with ``threads`` torch threads (default one: ranks share the machine's cores), joins a gloo group
through a file store in a temp folder of its own (no TCP port to race for), calls
``fn(rank, world_size, *args)`` and saves the result with ``torch.save``. It then
passes a barrier, destroys the group and leaves with ``os._exit``: letting gloo's threads shut down
with the interpreter intermittently aborts the process (ENVIRONMENT.md). ``fn`` must be a module-level
function, since spawned processes import it by name.

Ranks are forked from a forkserver that imported torch, transformers and the model code once
(``PRELOAD``): a fresh process per rank as under ``spawn`` (nothing one call leaves in a rank reaches
the next), without paying those imports (~3 CPU-s) again for every rank of every call.
"""

from __future__ import annotations

import os
import shutil
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmrl.runtime.debris import make_temp_dir
from mmrl.runtime.startup import freeze_heap

# imported once by the forkserver that forks every rank (names: the server imports them, not this
# process); a module missing here is imported by the rank
PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    "transformers.models.qwen2_5_vl.processing_qwen2_5_vl",
    "mmrl.workers.fsdp_engine",
    "mmrl.workers.actor",
)


def _rank_main(fn: Callable, rank: int, world_size: int, out_dir: str, args: tuple, threads: int) -> None:
    freeze_heap()  # the server's preloaded modules: this rank's collections skip them
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    exit_code = 0
    try:
        store = f"file://{Path(out_dir) / 'store'}"
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.error").write_text(traceback.format_exc())
        exit_code = 1
    os._exit(exit_code)


def run_on_ranks(
    fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0, threads: int = 1
) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, ...)]``, each computed in its own process.

    A rank that raises makes this raise with its traceback; the other ranks (which would wait for it
    in a collective) are killed. Ranks still running after ``timeout_s`` are killed too.
    """
    out_dir = make_temp_dir("dist")  # a later start-up removes it if this process is killed
    try:
        return _collect_results(fn, world_size, args, out_dir, timeout_s, threads)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def _rank_context():
    """The forkserver context whose server imported ``PRELOAD`` (started at the first call)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


def _collect_results(
    fn: Callable, world_size: int, args: tuple, out_dir: str, timeout_s: float, threads: int
) -> list[Any]:
    context = _rank_context()
    processes = [
        context.Process(target=_rank_main, args=(fn, rank, world_size, out_dir, args, threads), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    while any(process.is_alive() for process in processes) and time.monotonic() < deadline:
        if any(process.exitcode not in (None, 0) for process in processes):
            break
        time.sleep(0.05)
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()
    errors = sorted(Path(out_dir).glob("rank*.error"))
    if errors:
        raise RuntimeError("\n".join(f"{path.stem} failed:\n{path.read_text()}" for path in errors))
    exit_codes = [process.exitcode for process in processes]
    if any(code != 0 for code in exit_codes):
        raise RuntimeError(f"ranks exited with codes {exit_codes} (timeout {timeout_s} s or a crash)")
    return [torch.load(Path(out_dir) / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
