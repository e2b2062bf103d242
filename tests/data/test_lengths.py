"""The overlong-prompt filter's lengths: measured in spawned processes exactly as in-process, and
cached under a key that changes with the files and settings a length depends on."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from mmrl.data.config import DataConfig
from mmrl.data.dataset import DataError, PromptDataset
from mmrl.data.lengths import (
    Measured,
    cache_dir,
    cache_key,
    measure_prompt_lengths,
    process_count,
    spawn_pays_off,
)
from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS
from mmrl.trainer.ray_trainer import load_tokenizer_and_processor


@pytest.fixture(scope="module")
def vl(tiny_vl_path):
    return load_tokenizer_and_processor(str(tiny_vl_path))


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MMRL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "prompt_lengths"


def make_dataset(files, vl, **kwargs) -> PromptDataset:
    tokenizer, processor = vl
    options = {"max_prompt_length": 256, "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, **kwargs}
    return PromptDataset(str(files), tokenizer, processor, DataConfig(**options))


def mixed_rows(shapes_data_dir: Path, tmp_path: Path) -> Path:
    """The colour task's rows with an image copied in, a long text row and a row whose image is missing."""
    rows = [json.loads(line) for line in (shapes_data_dir / "train.jsonl").read_text().splitlines()]
    for row in rows:
        row["images"] = [str(shapes_data_dir / image) for image in row["images"]]
    rows[3]["problem"] = rows[3]["problem"] + " very" * 300  # overlong at max_prompt_length=256
    rows[7]["images"] = [str(tmp_path / "missing.png")]  # a bad row
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_process_count_uses_the_request_and_sizes_auto_by_rows():
    assert process_count(4, 10) == 4
    assert process_count(4, 3) == 3
    assert process_count(1, 10_000) == 1
    assert process_count(None, 10) == 1  # a small dataset is not worth a process start
    assert process_count(None, 10_000) == min(os.cpu_count() or 1, 32, 10_000 // 256)


def test_spawned_processes_measure_what_this_process_measures(shapes_data_dir, tmp_path, vl, private_cache):
    data = mixed_rows(shapes_data_dir, tmp_path)
    dataset = make_dataset(data, vl, filter_overlong_prompts=False)
    serial = measure_prompt_lengths(dataset, 1, cache=False)
    parallel = measure_prompt_lengths(dataset, 2, cache=False)
    assert parallel == serial
    assert serial[3].length > 256 and serial[0].length < 256
    assert serial[7].length is None and "row 7" in serial[7].error and "missing.png" in serial[7].error
    assert [m.length for m in serial] == [
        int(dataset._encode(p)["encoded"]["input_ids"].shape[-1]) if p != 7 else None
        for p in range(len(dataset))
    ]


def test_parallel_filter_keeps_and_skips_as_the_serial_one(shapes_data_dir, tmp_path, vl, private_cache):
    data = mixed_rows(shapes_data_dir, tmp_path)
    options = {"skip_bad_samples": True, "prompt_length_cache": False}
    serial = make_dataset(data, vl, preprocess_num_workers=1, **options)
    parallel = make_dataset(data, vl, preprocess_num_workers=2, **options)
    assert parallel.index == serial.index and len(serial) == 30
    assert parallel.num_filtered == serial.num_filtered == 1
    assert parallel.skipped == serial.skipped and list(serial.skipped) == [f"{data} row 7"]
    with pytest.raises(DataError, match="row 7.*missing.png"):
        make_dataset(data, vl, preprocess_num_workers=2, prompt_length_cache=False)


def test_a_second_run_reads_the_lengths_back(shapes_data_dir, tmp_path, vl, private_cache):
    data_dir = tmp_path / "copy"
    shutil.copytree(shapes_data_dir, data_dir)
    first = make_dataset(data_dir / "train.jsonl", vl, max_prompt_length=100)
    [cache_file] = list(private_cache.iterdir())
    assert cache_file.name == f"{cache_key(first)}.json"
    # the lengths come from the cache: the images are not read again (they are gone)
    shutil.rmtree(data_dir / "images")
    second = make_dataset(data_dir / "train.jsonl", vl, max_prompt_length=100)
    assert second.index == first.index and second.num_filtered == first.num_filtered
    # another max_prompt_length filters by the same stored lengths
    stored = json.loads(cache_file.read_text())["lengths"]
    tighter = make_dataset(data_dir / "train.jsonl", vl, max_prompt_length=sorted(stored)[10])
    assert len(tighter) == sum(length <= sorted(stored)[10] for length in stored)
    assert len(list(private_cache.iterdir())) == 1


def test_the_key_follows_the_files_and_the_settings(shapes_data_dir, tmp_path, vl, private_cache):
    data_dir = tmp_path / "copy"
    shutil.copytree(shapes_data_dir, data_dir)
    data = data_dir / "train.jsonl"
    base = cache_key(make_dataset(data, vl, filter_overlong_prompts=False))
    assert cache_key(make_dataset(data, vl, filter_overlong_prompts=False, max_prompt_length=64)) == base
    assert cache_key(make_dataset(data, vl, filter_overlong_prompts=False, max_pixels=MAX_PIXELS * 2)) != base
    assert cache_key(make_dataset(data, vl, filter_overlong_prompts=False, system_prompt="Be brief.")) != base
    # a multi-turn run's prompts show its tools' schemas (hundreds of tokens): not the same lengths
    tokenizer, processor = vl
    schema = [{"type": "function", "function": {"name": "zoom", "description": "Zoom in.", "parameters": {}}}]
    config = DataConfig(filter_overlong_prompts=False, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    assert cache_key(PromptDataset(str(data), tokenizer, processor, config, tools=schema)) != base
    data.write_text(data.read_text() + data.read_text().splitlines(keepends=True)[0])  # one more row
    assert cache_key(make_dataset(data, vl, filter_overlong_prompts=False)) != base
    text_tokenizer = (vl[0], None)
    assert (
        cache_key(make_dataset(data, text_tokenizer, filter_overlong_prompts=False, image_key="none")) != base
    )


def test_a_cache_of_other_rows_is_not_used(shapes_data_dir, tmp_path, vl, private_cache):
    dataset = make_dataset(shapes_data_dir / "train.jsonl", vl, filter_overlong_prompts=False)
    path = Path(cache_dir()) / f"{cache_key(dataset)}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"lengths": [1, 2, 3]}))  # say, a file cut short by hand
    measured = measure_prompt_lengths(dataset, 1, cache=True)
    assert len(measured) == 32 and all(isinstance(m, Measured) and m.length > 3 for m in measured)
    assert len(json.loads(path.read_text())["lengths"]) == 32  # rewritten whole


@pytest.mark.parametrize("family", ["tiny_vl_path", "tiny_qwen3_vl_path", "tiny_omni_path"])
@pytest.mark.parametrize("pixel_range", [(MIN_PIXELS, MAX_PIXELS), (262144, 4194304)])
def test_lengths_from_image_sizes_equal_the_encoded_ones(family, pixel_range, tmp_path, request):
    """The header-only count (each image's placeholder tokens from its size) against the processor's
    expansion: sizes that are upscaled, downscaled, kept, odd and very elongated; 0, 1 and 2 images."""
    from PIL import Image

    sizes = [(56, 56), (448, 448), (1000, 300), (97, 211), (2048, 1536), (30, 900)]
    rows = [{"problem": "No image here, just text.", "answer": "x"}]
    for index, (width, height) in enumerate(sizes):
        Image.new("RGB", (width, height), (index * 40, 0, 0)).save(tmp_path / f"{index}.jpg")
        rows.append({"problem": "<image>What colour?", "answer": "red", "images": [f"{index}.jpg"]})
    rows.append({"problem": "<image>and<image>?", "answer": "x", "images": ["0.jpg", "2.jpg"]})
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    vl = load_tokenizer_and_processor(str(request.getfixturevalue(family)))
    min_pixels, max_pixels = pixel_range
    dataset = make_dataset(
        data,
        vl,
        filter_overlong_prompts=False,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        max_prompt_length=10**6,
    )
    assert dataset._count_images_by_size
    for position in range(len(dataset)):
        counted, images = dataset._length_from_image_sizes(position)
        assert images == len(rows[position].get("images", []))
        assert counted == int(dataset._encode(position)["encoded"]["input_ids"].shape[-1]), rows[position]


def test_a_disagreeing_count_falls_back_to_encoding(shapes_data_dir, vl, monkeypatch):
    dataset = make_dataset(shapes_data_dir / "train.jsonl", vl, filter_overlong_prompts=False)
    encoded = int(dataset._encode(0)["encoded"]["input_ids"].shape[-1])
    # a processor whose patch count is off by one merged block (as a processor with other rules would be)
    image_processor = vl[1].image_processor
    true_count = image_processor.get_number_of_image_patches
    monkeypatch.setattr(
        image_processor,
        "get_number_of_image_patches",
        lambda h, w, kwargs: true_count(h, w, kwargs) + image_processor.merge_size**2,
    )
    assert dataset.prompt_length(0) == encoded
    assert not dataset._count_images_by_size  # switched off for the rest of the rows
    assert dataset.prompt_length(1) == int(dataset._encode(1)["encoded"]["input_ids"].shape[-1])


def test_a_truncated_image_passes_the_count_and_fails_at_load(tmp_path, vl):
    from PIL import Image

    Image.new("RGB", (64, 64), (200, 0, 0)).save(tmp_path / "whole.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "whole.png").read_bytes()[:100])
    data = tmp_path / "rows.jsonl"
    rows = [
        {"problem": "<image>Colour?", "answer": "red", "images": [name]} for name in ("whole.png", "cut.png")
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    dataset = make_dataset(data, vl, filter_overlong_prompts=False)
    assert dataset.prompt_length(0) == dataset.prompt_length(
        1
    )  # row 0 checks the count; row 1's header is whole
    with pytest.raises(DataError, match="row 1.*cut.png"):
        dataset[1]


def test_processes_start_only_when_the_rows_are_worth_their_start_up():
    # 10k rows counted from image headers (0.2 ms each): 2 s here, more than that to start processes
    assert not spawn_pays_off(10_000, 0.0002, 2)
    # 10k video rows encoded at 50 ms each: 500 s here, ~260 s in two processes
    assert spawn_pays_off(10_000, 0.05, 2)
    assert not spawn_pays_off(100, 0.05, 32)  # 5 s of work


def test_auto_measures_cheap_rows_in_this_process(shapes_data_dir, vl, monkeypatch, private_cache):
    import mmrl.data.lengths as lengths

    monkeypatch.setattr(lengths, "MIN_ROWS_PER_PROCESS", 1)  # 32 rows would otherwise be too few to ask
    monkeypatch.setattr(
        lengths,
        "ProcessPoolExecutor",
        lambda *args, **kwargs: pytest.fail("started processes for cheap rows"),
    )
    dataset = make_dataset(shapes_data_dir / "train.jsonl", vl, filter_overlong_prompts=False)
    measured = measure_prompt_lengths(dataset, None, cache=False)
    assert [m.length for m in measured] == [dataset.prompt_length(p) for p in range(len(dataset))]
