"""bench/token_head.py: the log-prob head's chunk math, eager against compiled, on the same numbers."""

from __future__ import annotations

import json

from _bench_run import run_bench


def test_the_compiled_chunk_math_is_timed_against_the_eager_ops_on_the_same_numbers(tmp_path):
    out = tmp_path / "token_head.json"
    stdout = run_bench(
        "token_head.py",
        "--tokens",
        "64",
        "--vocab",
        "512",
        "--repeats",
        "1",
        "--device",
        "cpu",
        "--out",
        str(out),
    )
    assert "| call | eager s | compiled s | compiled / eager | largest difference |" in stdout
    rows = json.loads(out.read_text())["result"]["rows"]
    assert [row["call"] for row in rows] == ["scores", "logit gradient", "logit gradient (entropy bonus)"]
    for row in rows:
        assert row["eager_s"] > 0 and row["compiled_s"] > 0
        assert row["largest_difference"] < 1e-4  # fp32: the same values, summed in another order
