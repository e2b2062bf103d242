"""The judge demo's pieces: its training rows, its prompt equal to what the served judge is sent, and a
judge the training script writes that vLLM's OpenAI-compatible server loads and answers through the
run's judge client."""

from __future__ import annotations

import glob
import json
import os
import tempfile

import numpy as np
import pytest

from mmrl.config import JudgeConfig
from mmrl.data.processing import PromptMedia
from mmrl.demo.judge import (
    TEMPLATE,
    judge_answer,
    judge_rows,
    junk_responses,
    lr_factor,
    render_prompt,
    train_judge,
)
from mmrl.rewards.judge import JudgeSource, build_judge
from mmrl.rewards.parsers import parse_yes_no
from mmrl.rewards.source import SampleFailure

COLOURS = ["blue", "green", "red", "yellow"]


def _images(data_dir):
    return [json.loads(line) for line in (data_dir / "val.jsonl").read_text().splitlines()]


def test_judge_rows_name_the_true_colour_then_say_yes_to_it_only_and_never_show_it(shapes_data_dir):
    images = _images(shapes_data_dir)
    rows = judge_rows(shapes_data_dir / "val.jsonl", TEMPLATE.read_text(), COLOURS, ("shape",))
    assert len(rows) == 5 * len(images)  # four colours and one word that is no colour, per image
    for index, image in enumerate(images):
        group = rows[5 * index : 5 * index + 5]
        assert [row["answer"] for row in group].count(f"{image['answer']} yes") == 1
        for row in group:
            response = row["problem"].split("Answer given: ")[1].split("\n")[0]
            verdict = "yes" if response == image["answer"] else "no"
            assert row["answer"] == f"{image['answer']} {verdict}"  # what it sees, then the verdict
            assert row["images"] == image["images"] and row["problem"].startswith("<image>")
            if response != image["answer"]:  # the prompt names no colour but the response's
                assert image["answer"] not in row["problem"]


def test_the_runs_parser_reads_the_verdict_after_the_named_colour():
    # the judge answers with the colour it sees first; yes_no reads the first yes/no word, the verdict
    assert parse_yes_no(judge_answer("red", "yes")) == 1.0
    assert parse_yes_no(judge_answer("yellow", "no")) == 0.0
    assert parse_yes_no("blue") is None  # cut before the verdict: unreadable


def test_junk_responses_are_decoded_vocabulary_that_names_no_colour(tiny_vl_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_vl_path)
    junk = junk_responses(tokenizer, np.random.default_rng(0), 200, COLOURS)
    assert len(junk) == 200 and len(set(junk)) > 100 and "" in junk  # varied, the empty answer among them
    for text in junk:
        assert text.strip().lower() not in COLOURS
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert not set(ids) & set(tokenizer.all_special_ids)


def test_the_learning_rate_warms_up_then_decays_to_its_floor():
    factors = [lr_factor(step, 110) for step in range(110)]
    assert factors[0] == 0.1 and factors[9] == 1.0  # linear over the 10 warm-up steps
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))  # then only down
    assert factors[-1] == pytest.approx(0.1, abs=1e-3)


def test_the_judge_is_trained_on_the_text_the_served_judge_is_sent(shapes_data_dir):
    image = _images(shapes_data_dir)[0]
    trained = render_prompt(TEMPLATE.read_text(), image["problem"], "blue")
    source = JudgeSource(client=None, model="judge", template=TEMPLATE.read_text())
    sample = {"problem": image["problem"], "response": "blue", "ground_truth": image["answer"]}
    sample["media"] = PromptMedia(prompt="", images=(str(shapes_data_dir / image["images"][0]),))
    content = source.request(0, sample)["messages"][0]["content"]
    assert [part["type"] for part in content] == ["image_url", "text"]
    assert trained == "<image>" + content[1]["text"]


@pytest.mark.slow
@pytest.mark.shares("vllm")
def test_a_trained_judge_is_served_by_vllm_and_answers(tiny_vl_path, shapes_data_dir, tmp_path, capsys):
    from mmrl.rewards.judge_server import VllmServer

    out = tmp_path / "judge"
    evaluation = train_judge(
        str(tiny_vl_path), str(shapes_data_dir), str(out), steps=1, batch_size=4, max_train_images=8,
        max_val_images=2,
    )  # fmt: skip
    assert evaluation["rows"] == 2 * 4 and 0.0 <= evaluation["accuracy"] <= 1.0
    assert len(evaluation["verdicts"]) == 8 and set(evaluation["verdicts"]) <= {"yes", "no"}
    assert evaluation["junk_rows"] == 2 * 2 and 0.0 <= evaluation["junk_no_accuracy"] <= 1.0
    capsys.readouterr()
    again = train_judge(
        str(tiny_vl_path), str(shapes_data_dir), str(out), steps=1, batch_size=4, max_train_images=8,
        max_val_images=2,
    )  # fmt: skip
    assert again == evaluation and "is up to date" in capsys.readouterr().out
    server = VllmServer(
        str(out), "judge", ["--max-model-len", "512", "--enforce-eager"], {"VLLM_CPU_KVCACHE_SPACE": "1"}
    )
    rendezvous_files = set(glob.glob(os.path.join(tempfile.gettempdir(), "vllm_dist_*")))
    try:
        base_url = server.start(timeout_s=300)
        folder = server.socket_dir
        # the file its engine's process group meets through is in the server's own folder
        assert glob.glob(os.path.join(folder, "vllm_dist_*"))
        assert base_url.startswith("http://127.0.0.1:")  # loopback: the served API has no key
        judge = build_judge(
            JudgeConfig(prompt_template=str(TEMPLATE), max_tokens=4, cache=False),
            base_url,
            "judge",
            None,
            "problem",
        )
        image = _images(shapes_data_dir)[0]
        media = PromptMedia(prompt="", images=(str(shapes_data_dir / image["images"][0]),))
        samples = [
            {"problem": image["problem"], "response": word, "media": media} for word in ("red", "blue")
        ]
        results = judge.score(samples)
        judge.close()
    finally:
        server.stop()
    # answered (one trained step leaves the judge's words unreadable or not: either is scored)
    assert not any(isinstance(result, SampleFailure) for result in results)
    assert all(result["overall"] in (0.0, 1.0) for result in results)
    assert not server.alive()
    # stopped, it left nothing: its folder is gone, and no file of it is in the system's temporary folder
    assert not os.path.exists(folder)
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "vllm_dist_*"))) <= rendezvous_files
