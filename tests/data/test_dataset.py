"""Prompt datasets: files of every supported kind, prompt rendering, media, padding, bad samples."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmrl.data.collate import collate_prompts, left_pad
from mmrl.data.config import DataConfig
from mmrl.data.dataset import DataError, PromptDataset, split_by_markers
from mmrl.data.media import MediaError, load_image, resize_to_pixel_range
from mmrl.data.processing import TOKEN_COLUMNS, PromptMedia, attach_media, load_tokenizer_and_processor
from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS


@pytest.fixture(scope="module")
def vl(tiny_vl_path):
    return load_tokenizer_and_processor(str(tiny_vl_path))


def make_dataset(files, vl, **kwargs) -> PromptDataset:
    tokenizer, processor = vl
    options = {"max_prompt_length": 256, "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, **kwargs}
    return PromptDataset(str(files), tokenizer, processor, DataConfig(**options))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def model_media(dataset: PromptDataset, item: dict) -> tuple[dict, dict]:
    """``(multi_modal_inputs, multi_modal_data)`` of one item, made as a worker makes them."""
    batch = attach_media(collate_prompts([item], 0), dataset.media, rollout_media=True)
    return batch.non_tensor_batch["multi_modal_inputs"][0], batch.non_tensor_batch["multi_modal_data"][0]


def png_bytes(size=(56, 56), color=(255, 0, 0)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def test_jsonl_item_has_model_and_rollout_inputs(shapes_data_dir, vl):
    tokenizer, processor = vl
    dataset = make_dataset(shapes_data_dir / "train.jsonl", vl)
    assert len(dataset) == 32
    item = dataset[0]
    inputs, rollout_media = model_media(dataset, item)
    grid = inputs["image_grid_thw"]
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # one placeholder per merged 2×2 patch block
    assert int((item["input_ids"] == image_pad).sum()) == int(grid.prod()) // 4
    assert item["mm_token_type_ids"].tolist() == (item["input_ids"] == image_pad).long().tolist()
    # the rollout engine gets the unexpanded prompt: a single placeholder per image
    assert item["raw_prompt_ids"].count(image_pad) == 1
    assert len(rollout_media["images"]) == 1
    # the item carries the image file's own bytes, no tensors and no decoded pixels
    path = (
        shapes_data_dir
        / json.loads((shapes_data_dir / "train.jsonl").read_text().splitlines()[0])["images"][0]
    )
    ((image,),) = [item["prompt_media"].images]
    assert isinstance(item["prompt_media"], PromptMedia) and image["bytes"] == path.read_bytes()
    others = [value for key, value in item.items() if key not in TOKEN_COLUMNS]
    assert not any(isinstance(value, (torch.Tensor, Image.Image, dict)) for value in others)
    assert "multi_modal_inputs" not in item and "multi_modal_data" not in item
    collated = collate_prompts([item, dataset[1]], tokenizer.pad_token_id)  # what the driver dispatches
    assert set(collated.batch.keys()) == set(TOKEN_COLUMNS)
    for column in collated.non_tensor_batch.values():
        assert not any(isinstance(value, (torch.Tensor, Image.Image, dict)) for value in column)
    assert item["ground_truth"] in {"red", "green", "blue", "yellow"}
    assert item["data_source"] == "shapes_color"
    text = tokenizer.decode(item["input_ids"])
    assert text.endswith("<|im_start|>assistant\n")
    assert "What colour is the shape?" in text
    assert dataset[0]["uid"] != dataset[0]["uid"]  # a fresh uid per draw: n samples of one draw share it


def test_parquet_with_embedded_images_matches_jsonl(tmp_path, vl):
    from mmrl.demo.synthetic import generate_shapes_dataset

    jsonl_dir = generate_shapes_dataset("color", tmp_path / "j", n_train=4, n_val=1, seed=3, fmt="jsonl")
    parquet_dir = generate_shapes_dataset("color", tmp_path / "p", n_train=4, n_val=1, seed=3, fmt="parquet")
    jsonl, parquet = (
        make_dataset(jsonl_dir / "train.jsonl", vl),
        make_dataset(parquet_dir / "train.parquet", vl),
    )
    from_jsonl, from_parquet = jsonl[2], parquet[2]
    assert torch.equal(from_jsonl["input_ids"], from_parquet["input_ids"])
    assert from_jsonl["prompt_media"].images[0]["bytes"] == from_parquet["prompt_media"].images[0]["bytes"]
    assert torch.equal(
        model_media(jsonl, from_jsonl)[0]["pixel_values"],
        model_media(parquet, from_parquet)[0]["pixel_values"],
    )


def test_datasets_folder_with_split_and_comma_list(tmp_path, shapes_data_dir, vl):
    import datasets

    rows = [json.loads(line) for line in (shapes_data_dir / "val.jsonl").read_text().splitlines()]
    for row in rows:
        row["images"] = [{"bytes": (shapes_data_dir / row["images"][0]).read_bytes(), "path": None}]
    folder = tmp_path / "saved"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(folder))
    dataset = make_dataset(f"{folder}@test,{shapes_data_dir / 'val.jsonl'}", vl)
    assert len(dataset) == 2 * len(rows)
    assert torch.equal(dataset[0]["input_ids"], dataset[len(rows)]["input_ids"])
    assert "saved@test row 0" in dataset.where(0)


def test_format_prompt_gets_content_and_columns(tmp_path, vl):
    template = tmp_path / "t.jinja"
    template.write_text("[{{ data_source }}] {{ content | trim }} Think first.")
    data = write_jsonl(tmp_path / "d.jsonl", [{"problem": " 2+2? ", "answer": "4", "data_source": "arith"}])
    dataset = make_dataset(data, vl, format_prompt=str(template), system_prompt="Be brief.")
    item = dataset[0]
    text = vl[0].decode(item["input_ids"])
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text
    assert "<|im_start|>user\n[arith] 2+2? Think first.<|im_end|>" in text
    assert item["prompt_media"] is None and model_media(dataset, item) == ({}, {})


def test_images_from_bytes_dict_path_and_pil_resized_into_range(tmp_path):
    (tmp_path / "a.png").write_bytes(png_bytes((400, 100)))
    for ref in (
        png_bytes((400, 100)),
        {"bytes": png_bytes((400, 100)), "path": "x"},
        "a.png",
        Image.new("L", (400, 100)),
    ):
        image = load_image(ref, min_pixels=100, max_pixels=10_000, base_dir=str(tmp_path))
        assert image.mode == "RGB"
        assert image.width * image.height <= 10_000 and image.width / image.height == pytest.approx(
            4, rel=0.05
        )
    grown = resize_to_pixel_range(Image.new("RGB", (30, 40)), min_pixels=4800, max_pixels=10**6)
    assert grown.width * grown.height >= 4800 and grown.size == (60, 80)


def test_collate_left_pads(tmp_path, vl):
    rows = [{"problem": "hi", "answer": "a"}, {"problem": "a much longer question here", "answer": "b"}]
    dataset = make_dataset(write_jsonl(tmp_path / "d.jsonl", rows), vl)
    short, long = dataset[0], dataset[1]
    batch = collate_prompts([short, long], pad_token_id=vl[0].pad_token_id)
    pad = len(long["input_ids"]) - len(short["input_ids"])
    assert pad > 0
    assert batch.batch["input_ids"][0, :pad].eq(vl[0].pad_token_id).all()
    assert batch.batch["attention_mask"][0].tolist() == [0] * pad + [1] * len(short["input_ids"])
    assert torch.equal(batch.batch["input_ids"][0, pad:], short["input_ids"])
    assert list(batch.non_tensor_batch["ground_truth"]) == ["a", "b"]
    assert left_pad([torch.tensor([1, 2]), torch.tensor([3])], 0).tolist() == [[1, 2], [0, 3]]


def test_overlong_prompts_filtered_and_counted_or_rejected(tmp_path, vl):
    rows = [{"problem": "short", "answer": "a"}, {"problem": "word " * 200, "answer": "b"}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    dataset = make_dataset(data, vl, max_prompt_length=64)
    assert len(dataset) == 1 and dataset.num_filtered == 1
    unfiltered = make_dataset(data, vl, max_prompt_length=64, filter_overlong_prompts=False)
    with pytest.raises(
        DataError, match=r"d\.jsonl row 1: prompt is \d+ tokens, over data.max_prompt_length=64"
    ):
        unfiltered[1]


def test_text_only_model_uses_tokenizer_template(tmp_path, tiny_text_path):
    tokenizer, processor = load_tokenizer_and_processor(str(tiny_text_path))
    assert processor is None
    data = write_jsonl(tmp_path / "d.jsonl", [{"problem": "1+1?", "answer": "2"}])
    item = PromptDataset(str(data), tokenizer, None, DataConfig())[0]
    assert tokenizer.decode(item["input_ids"]).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"problem": "<image>x", "answer": "a", "images": ["missing.png"]},
            r"bad\.jsonl row 0: image file .*missing\.png' does not exist",
        ),
        (
            {"problem": "<image>x", "answer": "a", "images": [{"bytes": "bm90IGFuIGltYWdl", "path": None}]},
            r"row 0: cannot decode image",
        ),
        ({"problem": 42, "answer": "a"}, r"row 0: column 'problem' must be a string, found int"),
        ({"question": "x", "answer": "a"}, r"row 0: no column 'problem' \(data.prompt_key\)"),
        (
            {"problem": "x", "answer": "a", "images": ["img.png"]},
            r"row 0: the prompt has 0 <image> marker\(s\) but the sample has 1 image",
        ),
        ({"problem": "<image><image>x", "answer": "a", "images": ["img.png"]}, r"has 2 <image> marker\(s\)"),
        (
            {"problem": "<video>x", "answer": "a", "videos": ["v.mp4"]},
            r"bad\.jsonl row 0: video file .*v\.mp4' does not exist",
        ),
    ],
)
def test_bad_samples_name_file_and_row(tmp_path, vl, row, message):
    (tmp_path / "img.png").write_bytes(png_bytes())
    dataset = make_dataset(write_jsonl(tmp_path / "bad.jsonl", [row]), vl, filter_overlong_prompts=False)
    with pytest.raises(DataError, match=message):
        dataset[0]


def test_image_too_small_for_a_patch(tmp_path, vl):
    data = write_jsonl(tmp_path / "d.jsonl", [{"problem": "<image>x", "answer": "a", "images": ["tiny.png"]}])
    # a thin image shrunk under max_pixels floors its short side to 0 patches (qwen-vl-utils would crash)
    (tmp_path / "tiny.png").write_bytes(png_bytes((5000, 26)))
    with pytest.raises(DataError, match=r"d\.jsonl row 0: image .* both sides must be >= 28 pixels"):
        make_dataset(data, vl, min_pixels=1, max_pixels=3136, filter_overlong_prompts=False)[0]
    (tmp_path / "tiny.png").write_bytes(png_bytes((10, 200)))  # small sides are padded up to one patch
    assert make_dataset(data, vl, min_pixels=1, filter_overlong_prompts=False)[0]["input_ids"].numel()
    (tmp_path / "tiny.png").write_bytes(png_bytes((2010, 10)))
    with pytest.raises(DataError, match=r"row 0: image .*aspect ratio over 200"):
        make_dataset(data, vl, min_pixels=1, filter_overlong_prompts=False)[0]
    with pytest.raises(MediaError, match="neither 'bytes' nor 'path'"):
        load_image({}, 1, 10**6)


def test_invalid_json_line_names_line(tmp_path, vl):
    data = tmp_path / "broken.jsonl"
    data.write_text('{"problem": "a", "answer": "b"}\n{"problem": \n')
    with pytest.raises(DataError, match=r"broken\.jsonl line 2: not valid JSON"):
        make_dataset(data, vl)


def test_split_by_markers():
    assert split_by_markers("<image>What? <video>and<audio>") == [
        {"type": "image"},
        {"type": "text", "text": "What? "},
        {"type": "video"},
        {"type": "text", "text": "and"},
        {"type": "audio"},
    ]


def test_override_chat_template_renders_every_prompt(tmp_path, tiny_vl_path, tiny_text_path):
    """EasyR1's data.override_chat_template: the file replaces the chat template of the tokenizer and
    the processor, so the dataset's prompts (and their counted lengths) are rendered with it."""
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m['role'] }}] "
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for part in m['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}\n{% endfor %}[assistant] "
    )
    data = write_jsonl(tmp_path / "d.jsonl", [{"problem": "1+1?", "answer": "2"}])
    for model in (tiny_text_path, tiny_vl_path):
        tokenizer, processor = load_tokenizer_and_processor(str(model), chat_template_file=str(template))
        assert tokenizer.chat_template == template.read_text()
        item = PromptDataset(str(data), tokenizer, processor, DataConfig())[0]
        # (transformers renders chat templates with trim_blocks: the newline after a tag is dropped)
        assert tokenizer.decode(item["input_ids"]) == "[user] 1+1?[assistant] "


# ---------------------------------------------------------------- every data format


FORMAT_ROWS = [
    {"problem": f"<image>Which colour is shape {index}?", "answer": colour, "images": f"images/{index}.png"}
    for index, colour in enumerate(["red", "green", "blue"])
]  # strings only: a CSV cell holds no list, and its numbers would come back as numbers


def _write_rows(folder: Path, fmt: str) -> str:
    """FORMAT_ROWS written as ``fmt``; returns the data spec that names them."""
    import datasets
    import pyarrow as pa
    import pyarrow.csv
    import pyarrow.feather

    folder.mkdir()
    table = pa.Table.from_pylist(FORMAT_ROWS)
    if fmt == "csv":
        pa.csv.write_csv(table, folder / "train.csv")
        return str(folder / "train.csv")
    if fmt == "json list":
        (folder / "train.json").write_text(json.dumps(FORMAT_ROWS))
        return str(folder / "train.json")
    if fmt == "json lines in .json":  # what `datasets` reads from a .json file as well
        write_jsonl(folder / "train.json", FORMAT_ROWS)
        return str(folder / "train.json")
    if fmt == "jsonl":
        return str(write_jsonl(folder / "train.jsonl", FORMAT_ROWS))
    if fmt == "parquet":
        import pyarrow.parquet

        pa.parquet.write_table(table, folder / "train.parquet")
        return str(folder / "train.parquet")
    if fmt == "arrow stream (datasets' data files)":
        with pa.ipc.new_stream(folder / "train.arrow", table.schema) as writer:
            writer.write_table(table)
        return str(folder / "train.arrow")
    if fmt == "arrow file (feather)":
        pa.feather.write_feather(table, folder / "train.arrow")
        return str(folder / "train.arrow")
    if fmt == "save_to_disk folder@split":
        splits = {
            "train": datasets.Dataset.from_list(FORMAT_ROWS[:1]),
            "test": datasets.Dataset.from_list(FORMAT_ROWS),
        }
        datasets.DatasetDict(splits).save_to_disk(str(folder / "saved"))
        return f"{folder / 'saved'}@test"
    if fmt == "save_to_disk folder of one split":
        datasets.Dataset.from_list(FORMAT_ROWS).save_to_disk(str(folder / "saved"))
        return str(folder / "saved")
    assert fmt == "folder of files@split"  # datasets.load_dataset, as for a hub id: splits by file name
    pa.csv.write_csv(table.slice(0, 1), folder / "train.csv")
    pa.csv.write_csv(table, folder / "test.csv")
    return f"{folder}@test"


@pytest.mark.parametrize(
    "fmt",
    [
        "csv",
        "json list",
        "json lines in .json",
        "jsonl",
        "parquet",
        "arrow stream (datasets' data files)",
        "arrow file (feather)",
        "save_to_disk folder@split",
        "save_to_disk folder of one split",
        "folder of files@split",
    ],
)
def test_every_data_format_loads_the_same_rows(tmp_path, monkeypatch, fmt):
    import datasets

    from mmrl.data.dataset import load_rows

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")  # not the home folder
    rows = load_rows(_write_rows(tmp_path / "data", fmt))
    assert [dict(row) for row in rows.table] == FORMAT_ROWS


def test_a_format_mmrl_does_not_read_is_named_with_the_accepted_ones(tmp_path):
    from mmrl.data.dataset import load_rows

    (tmp_path / "train.txt").write_text("a\nb\n")
    with pytest.raises(
        DataError, match=r"train\.txt' \(\.txt\) is not a data format mmrl reads: give a \.jsonl"
    ):
        load_rows(str(tmp_path / "train.txt"))
