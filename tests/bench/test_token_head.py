"""bench/token_head.py: the log-prob head's chunk math, eager against compiled, on the same numbers."""

from __future__ import annotations

import json

from _bench_run import BENCH_DIR, run_bench


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


def test_the_whole_head_is_timed_against_the_plain_head_on_the_same_numbers(tmp_path):
    out = tmp_path / "token_head_whole.json"
    stdout = run_bench(
        "token_head.py",
        "--whole",
        *("--tokens", "40", "--width", "16", "--vocab", "300", "--chunk_tokens", "20"),
        *("--temperature", "0.7", "--repeats", "1", "--device", "cpu", "--out", str(out)),
    )
    assert "| head | entropies | rows a chunk | forward s | backward s | both / plain's |" in stdout
    assert "left out: liger: Liger's kernels are Triton's: a GPU only" in stdout
    result = json.loads(out.read_text())["result"]
    rows = {row["head"]: row for row in result["rows"]}
    assert list(rows) == ["plain", "mmrl", "mmrl compiled"]
    assert [row["entropies"] for row in rows.values()] == [False, True, True]
    assert [row["chunk_rows"] for row in rows.values()] == [40, 20, 20]
    for row in rows.values():
        assert row["forward_s"] > 0 and row["backward_s"] > 0
        # fp32, two chunks of 20 rows, a temperature: the plain head's numbers
        for key in ("log_prob_difference", "hidden_grad_difference", "weight_grad_difference"):
            assert row[key] < 1e-5, (row["head"], key, row[key])


def test_liger_s_chunk_follows_its_memory_bound(monkeypatch):
    """Liger 0.8.5 bounds a chunk's logits by chunk_mem_const x the input's size, in a power of two of
    rows: at the 3B width and vocabulary ceil(151,936 / 2,048) = 75 pieces, so 4,096 rows go 55 -> 64 a
    chunk and 1,024 rows 14 -> 16; chunk_mem_const 19 makes 4 pieces, 1,024 rows a chunk."""
    import importlib.util

    monkeypatch.syspath_prepend(str(BENCH_DIR))  # its own imports: bench/harness.py
    spec = importlib.util.spec_from_file_location("token_head", BENCH_DIR / "token_head.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench._liger_chunk_rows(4096, 2048, 151936, 1) == 64
    assert bench._liger_chunk_rows(1024, 2048, 151936, 1) == 16
    assert bench._liger_chunk_rows(4096, 2048, 151936, 19) == 1024
    assert bench._liger_chunk_rows(40, 16, 300, 1) == 4  # 19 pieces: 3 rows, a power of two
    assert bench._liger_chunk_rows(40, 16, 300, 100) == 40  # one piece: never more than the rows
