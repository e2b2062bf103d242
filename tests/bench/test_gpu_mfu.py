"""bench/gpu_mfu.py's CPU mode: aten ops of mmrl's real update path and of the plain FSDP2 loop, counted
on the same model and batch (tiny widths here: no count depends on them), and the two updates' numbers."""

from __future__ import annotations

import json

import pytest
from _bench_run import BENCH_DIR, run_bench

BENCH = BENCH_DIR / "gpu_mfu.py"


def test_cpu_mode_counts_both_sides_and_mmrl_does_no_more_host_work_per_parameter_or_layer(tmp_path):
    out = tmp_path / "ops.json"
    args = [
        "--device",
        "cpu",
        "--widths",
        "smoke",
        "--vocab",
        "512",
        "--vision_depth",
        "1",
        "--out",
        str(out),
    ]
    stdout = run_bench("gpu_mfu.py", *args, timeout_s=600)
    assert "| what | ops mmrl | ops plain |" in stdout
    sides = json.loads(out.read_text())["result"]["sides"]
    mmrl, plain = sides["mmrl"]["table"], sides["plain"]["table"]
    # every decoder layer and every micro-batch dispatches ops on both sides; the plain loop's
    # packing-free forward does no per-row work, and no host sync inside its micro-batch loop
    for side in (mmrl, plain):
        assert side["per decoder layer, per micro-batch"]["ops"] > 100
        assert side["per micro-batch"]["ops"] > side["per decoder layer, per micro-batch"]["ops"]
    assert plain["per extra row in a micro-batch"]["ops"] < 1
    # the bench's rows have no padding: mmrl runs them as the dense batch, so no decoder layer reshapes
    # a packed row for attention and each layer dispatches what the plain loop's does (was 34 more)
    layer = "per decoder layer, per micro-batch"
    assert mmrl[layer]["ops"] <= plain[layer]["ops"]
    # text rows: the vision tower (its own FSDP unit) is never gathered, so no cast or copy of its
    # tensors (before, the root unit's gather made one of each per tower tensor and micro-batch);
    # one of each per micro-batch is left above the plain loop
    for column in ("copy_", "_to_copy"):
        assert mmrl["per micro-batch"][column] <= plain["per micro-batch"][column] + 1, column
    # the optimizer step and clipping: foreach/fused on the shards, no per-parameter op (point 2)
    step = "per parameter tensor, optimizer + clipping"
    assert mmrl[step]["ops"] <= plain[step]["ops"] < 1
    # same weights, same batch: the two updates compute the same loss and gradient norm up to bf16
    # compute (packed vs padded rows round differently; in fp32 they agree to 6 digits, `--smoke`)
    numbers = {name: side["metrics"] for name, side in sides.items()}
    assert numbers["mmrl"]["loss"] == pytest.approx(numbers["plain"]["loss"], rel=1e-2, abs=1e-3)
    assert numbers["mmrl"]["grad_norm"] == pytest.approx(numbers["plain"]["grad_norm"], rel=5e-2)


def test_sides_time_several_settings_in_one_run_on_the_same_numbers(tmp_path):
    """``--sides`` (the timed path, ``--smoke``: tiny, fp32, on the CPU): each named setting is built and
    timed from the same weights and batch (compiled decoder layers and head, micro-batches by token
    budget; one of the two layers recomputing, parameters kept gathered from forward to backward and
    across micro-batches, one gradient reduction per step), with the same loss and gradient norm, on
    rows padded to a rollout's spread of lengths (mmrl packs them, the plain loop passes their mask); a
    setting that cannot be built is reported and the others still run."""
    out = tmp_path / "smoke.json"
    sides = (
        "mmrl:full,mmrl:off+compile+head+budget,mmrl:1+keep+hold+once,"
        "plain:full+compile,plain:1+keep,plain:off+hold,plain:off+budget,plain:off"
    )
    stdout = run_bench(
        "gpu_mfu.py",
        *("--smoke", "--varied", "--max_tokens", "100", "--sides", sides, "--out", str(out)),
        timeout_s=600,
    )
    result = json.loads(out.read_text())["result"]
    assert list(result["sides"]) == [
        "mmrl:full",
        "mmrl:off+compile+head+budget",
        "mmrl:1+keep+hold+once",
        "plain:1+keep",
        "plain:off",
    ]
    assert result["failed"] == {
        "plain:full+compile": "ValueError: the plain loop compiles nothing",
        "plain:off+hold": "ValueError: the plain loop reshards its parameters after every backward",
        "plain:off+budget": "ValueError: the plain loop batches by row count",
    }
    assert "plain:full+compile failed: ValueError" in stdout
    # 4 rows of 16 prompt + 16 response tokens, padded: only the valid tokens count as work
    assert result["padded_tokens_per_update"] == 128
    assert 4 * 16 // 2 < result["tokens_per_update"] < 128
    # by row count: 2 micro-batches of 2 rows; the budget of 100 tokens holds the 4 rows in one
    micro_batches = {spec: side["micro_batches"] for spec, side in result["sides"].items()}
    assert micro_batches == {spec: 1 if "+budget" in spec else 2 for spec in result["sides"]}
    reference = result["sides"]["mmrl:full"]["metrics"]
    for side in result["sides"].values():
        assert side["metrics"]["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert side["metrics"]["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    assert "mmrl:off+compile+head+budget tokens/s:" in stdout and "x plain:off" in stdout
    assert "+budget sides: 100 tokens" in stdout


def test_a_side_is_named_by_its_checkpointing_and_options():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_mfu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.parse_side("mmrl:full+compile") == bench.Side("mmrl", True, None, compiled=True)
    assert bench.parse_side("plain:off") == bench.Side("plain", False)
    assert bench.parse_side("mmrl:28+once+keep") == bench.Side("mmrl", True, 28, keep=True, once=True)
    assert bench.parse_side("mmrl:off+hold+head") == bench.Side("mmrl", False, head=True, hold=True)
    assert bench.parse_side("mmrl:full+budget") == bench.Side("mmrl", True, budget=True)
    for spec_text in (
        "mmrl:sometimes",
        "mmrl",
        "torch:full",
        "mmrl:full+fast",
        "mmrl:-2",
        "mmrl:full+keep+keep",
    ):
        with pytest.raises(SystemExit, match=r"name:checkpointing\[\+option\.\.\.\]"):
            bench.parse_side(spec_text)


def test_kernels_are_sorted_by_kind_and_product_kernels_compared_side_by_side(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_mfu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.kernel_kind("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "matmul"
    assert bench.kernel_kind("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "compiled (triton)"
    assert bench.kernel_kind("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise"
    assert bench.kernel_kind("ncclDevKernel_AllGather_RING_LL") == "collective"
    assert bench.kernel_kind("some_kernel") == "other"
    sides = {
        "mmrl:full": {"product_kernels": {"nvjet_a": (10, 5.0), "nvjet_b": (2, 1.0)}},
        "mmrl:full+compile": {"product_kernels": {"nvjet_a": (10, 6.5), "sm90_xmma_c": (2, 3.0)}},
        "plain:full": {},  # not profiled
    }
    bench.print_product_kernels({"sides": sides})
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[2:] == [
        "| kernel | mmrl:full | mmrl:full+compile |",
        "|---|---|---|",
        "| nvjet_a | 10, 5.0 | 10, 6.5 |",  # the kernel taking longest on some side first
        "| sm90_xmma_c | - | 2, 3.0 |",
        "| nvjet_b | 2, 1.0 | - |",
    ]


def test_the_device_sampler_reads_the_clock_and_power_while_its_block_runs():
    import importlib.util
    import time

    spec = importlib.util.spec_from_file_location("gpu_mfu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    readings = iter([(1980.0, 690.0), (1755.0, 700.0), (1755.0, 698.0)] + [(1500.0, 650.0)] * 1000)
    with bench.DeviceSampler(lambda: next(readings), interval_s=0.01) as sampler:
        while len(sampler.samples) < 3:
            time.sleep(0.005)
    taken = len(sampler.samples)
    time.sleep(0.05)
    assert len(sampler.samples) == taken  # no reading after the block
    first = [(1980.0, 690.0), (1755.0, 700.0), (1755.0, 698.0)]
    assert sampler.samples[:3] == first
    clocks = sorted(mhz for mhz, _ in sampler.samples)
    assert sampler.clock_mhz == pytest.approx((clocks[(taken - 1) // 2] + clocks[taken // 2]) / 2)
    assert sampler.power_w == pytest.approx(sum(watts for _, watts in sampler.samples) / taken)
    # no NVML (the CPU): nothing read, no figures
    with bench.DeviceSampler(None) as idle:
        time.sleep(0.02)
    assert idle.samples == [] and idle.clock_mhz is None and idle.power_w is None
    import torch

    assert bench.nvml_reader(torch.device("cpu")) is None
