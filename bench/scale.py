"""What the real job costs, before and after issues 14 and 25: the tables of the scale benchmarks.

    python bench/scale.py [--run memory media startup smoke load phases] [--quick]

- ``scale_memory``: peak memory and tokens/s of the log-prob pass and of one actor update vs response
  length (512…4,096) at the real vocabulary (151,936), unchunked (before) and chunked (after);
- ``scale_media``: bytes moved through Ray in one step, media as tensors in every dispatch (before)
  and media put once as their files (after), against the encoded media size;
- ``scale_startup``: time to the first batch for 10k image rows (the overlong-prompt filter);
- ``scale_smoke``: two GRPO steps at Qwen2.5-VL-3B's widths: peak memory per worker and phase;
- ``scale_load``: host memory of building the 3B-width model on 2 ranks, every rank reading vs rank 0's
  broadcast;
- ``scale_phases``: peak memory per phase with the small VL model at the real vocabulary on 2 ranks.

``--run`` runs the named ones (each as its own process, with its own defaults; ``--quick`` shortens
them), then every table is printed from ``bench/results/scale_*.json``, the last results of each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results"
QUICK = {
    "memory": ["--lengths", "512", "2048", "--update_lengths", "512"],
    "media": ["--prompts", "16"],
    "startup": ["--rows", "2000"],
    "smoke": [],
    "load": [],
    "phases": ["--responses", "256", "--steps", "1"],
}


def _tables() -> list[tuple[str, str, callable]]:
    sys.path.insert(0, str(BENCH_DIR))
    import scale_load
    import scale_media
    import scale_memory
    import scale_phases
    import scale_smoke
    import scale_startup

    return [
        ("memory", "memory at the real vocabulary vs response length (MB)", lambda d: scale_memory.format_table(d["rows"])),
        ("media", "bytes through Ray per step (MB)", lambda d: scale_media.markdown(scale_media.rows(d))),
        ("startup", "time to the first batch", lambda d: scale_startup.format_table(d["table"], d["args"]["rows"])),
        ("smoke", "real-shape GRPO steps: peak memory per worker and phase", lambda d: scale_smoke.format_table(d["rows"])),
        ("load", "host memory of building the 3B-width model on 2 ranks (MB)", lambda d: scale_load.format_table(d["rows"])),
        ("phases", "peak memory per phase at the real vocabulary, small VL model, 2 ranks", lambda d: scale_phases.format_table(d["rows"])),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", nargs="*", default=[], choices=sorted(QUICK))
    parser.add_argument("--quick", action="store_true", help="fewer lengths, prompts and rows")
    args = parser.parse_args(argv)
    for name in args.run:
        command = [sys.executable, str(BENCH_DIR / f"scale_{name}.py"), *(QUICK[name] if args.quick else [])]
        print(f"$ {' '.join(command)}", flush=True)
        subprocess.run(command, check=True)
    for name, title, table in _tables():
        path = RESULTS / f"scale_{name}.json"
        if not path.is_file():
            print(f"\n## {title}\n\n(missing: {path}; run `python bench/scale.py --run {name}`)")
            continue
        print(f"\n## {title} ({path.name})\n\n{table(json.loads(path.read_text()))}")


if __name__ == "__main__":
    main()
