"""Every broken input ends the run with exit code 2 and one message that names the file, row or key and
says what to do, without a traceback, before Ray starts (mmrl.trainer.main, mmrl.trainer.preflight).

Each case builds one broken input from the tiny fixtures (the colour-shapes data, the tiny Qwen2.5-VL,
Qwen2.5-Omni and Qwen3.5) over a run that is otherwise valid (``test_the_valid_run_passes_preflight``), calls
``main`` in-process, and checks the exit code, the named thing, the hint and that Ray never started.
A few cases run as a real ``python -m mmrl.trainer.main`` to show what reaches a terminal.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from _trainer_run import FINGERPRINT_REWARD, REPO_ROOT, small_run_overrides
from omegaconf import OmegaConf
from PIL import Image

from mmrl.config.loading import load_config
from mmrl.trainer.main import main
from mmrl.trainer.preflight import preflight

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))  # tests/data/_av.py: audio and video
import _warm_start as warm
from _av import grey_frames, tone, write_video, write_wav  # noqa: E402

# a case that takes longer did more than check inputs (Ray, a model's weights); a worker's first case also
# imports what preflight reads with (transformers' processors, datasets): seconds on a loaded machine
MAX_CASE_S = 30.0


@dataclass
class Inputs:
    """A valid run's inputs, and a folder for one case's broken copy of one of them."""

    model: Path  # the tiny Qwen2.5-VL
    omni: Path  # the tiny Qwen2.5-Omni (audio)
    data: Path  # the colour-shapes data: train.jsonl, val.jsonl, images/
    config: Path  # the valid run's YAML (one file merges in one pass; twenty overrides take twenty)
    tmp: Path  # this case's own folder

    def args(self, *extra: str) -> list[str]:
        return [f"config={self.config}", f"trainer.save_checkpoint_path={self.tmp / 'run'}", *extra]

    def rows(self, split: str = "train") -> list[dict]:
        return [json.loads(line) for line in (self.data / f"{split}.jsonl").read_text().splitlines()]

    def jsonl(self, rows: list[dict], name: str = "train.jsonl") -> Path:
        """``rows`` as a data file whose relative media paths resolve against the colour data."""
        path = self.tmp / name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return path

    def train(self, rows: list[dict], *extra: str) -> list[str]:
        return self.args(f"data.train_files={self.jsonl(rows)}", f"data.media_dir={self.data}", *extra)

    def file(self, key: str, name: str, text: str) -> str:
        """``key=path`` of a file ``name`` written with ``text``."""
        return f"{key}={self.write(name, text)}"

    def write(self, name: str, text: str) -> Path:
        (self.tmp / name).write_text(text)
        return self.tmp / name

    def model_copy(self, drop: tuple[str, ...] = (), config: dict | None = None) -> Path:
        """The tiny VL model's folder without its weights and ``drop``, its config.json updated by ``config``."""
        folder = self.tmp / "model"
        shutil.copytree(self.model, folder, ignore=shutil.ignore_patterns("*.safetensors", *drop))
        if config is not None:
            path = folder / "config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
        return folder


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    """Good and bad media files the cases point at."""
    folder = tmp_path_factory.mktemp("media")
    write_wav(folder / "tone_8k.wav", [tone(0.5, 8000)], 8000)  # resampled to the model's 16 kHz
    write_wav(folder / "silence.wav", [tone(0.5, amplitude=0.0)], 16000)
    write_wav(folder / "empty.wav", [], 16000)
    (folder / "noise.wav").write_bytes(b"RIFF\x00\x00 this is no audio " * 32)
    (folder / "noise.mp4").write_bytes(b"\x00 not a video " * 64)
    write_video(folder / "frameless.mkv", None, fps=4, audio=tone(0.2))
    write_video(folder / "clip.mp4", grey_frames(4), fps=2)
    Image.new("RGB", (2, 600)).save(folder / "thin.png")  # over the 200:1 Qwen-VL can encode
    (folder / "noise.png").write_bytes(b"this is no image" * 16)
    Image.new("RGB", (64, 64), (0, 200, 0)).save(folder / "whole.png")
    whole = (folder / "whole.png").read_bytes()
    (folder / "truncated.png").write_bytes(whole[: len(whole) // 2])  # header intact: found by decoding
    return folder


@pytest.fixture(scope="module")
def valid_config(tiny_vl_path, shapes_data_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "run.yaml"
    OmegaConf.save(OmegaConf.from_dotlist(small_run_overrides(tiny_vl_path, shapes_data_dir, "unused")), path)
    return path


@pytest.fixture
def inputs(tiny_vl_path, tiny_omni_path, shapes_data_dir, valid_config, tmp_path) -> Inputs:
    return Inputs(Path(tiny_vl_path), Path(tiny_omni_path), Path(shapes_data_dir), valid_config, tmp_path)


def _saved_dataset(inputs: Inputs) -> Path:
    """The colour rows as a ``datasets`` save_to_disk folder with train and test splits."""
    import datasets

    rows = [{**row, "images": [str(inputs.data / row["images"][0])]} for row in inputs.rows()]
    splits = {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:4])}
    datasets.disable_progress_bars()  # the case reads stderr: only mmrl's message may be there
    try:
        datasets.DatasetDict(splits).save_to_disk(str(inputs.tmp / "saved"))
    finally:
        datasets.enable_progress_bars()
    return inputs.tmp / "saved"


def _row(inputs: Inputs, index: int = 0, **changes) -> dict:
    return {**inputs.rows()[index], **changes}


def _with_row(inputs: Inputs, position: int, row: dict) -> list[dict]:
    rows = inputs.rows()
    rows[position] = row
    return rows


def _omni_audio(inputs: Inputs, media: Path, clip: str) -> list[str]:
    rows = [
        {"problem": "<audio>How many beeps?", "answer": "one", "audios": [str(media / clip)]}
        for _ in range(4)
    ]
    return [
        *inputs.args(
            f"data.train_files={inputs.jsonl(rows)}", f"worker.actor.model.model_path={inputs.omni}"
        ),
        "data.val_files=''",
        "data.max_prompt_length=256",
    ]


class _RunsCommand:
    """Unpickles as ``os.system("true")``: a tampered checkpoint's payload (harmless here)."""

    def __reduce__(self):
        return os.system, ("true",)


def _tampered_checkpoint(inputs: Inputs) -> list[str]:
    """A complete global_step_2 folder whose actor rank file carries a pickled command."""
    import torch

    from mmrl.checkpoint.state import rank_file, save_train_state

    step = inputs.tmp / "global_step_2"
    model = torch.nn.Linear(2, 2)
    save_train_state(step / "actor", model, torch.optim.SGD(model.parameters()))
    (step / "trainer_state.json").write_text("{}")
    torch.save({"rng": _RunsCommand()}, step / "actor" / rank_file(0))
    return inputs.args(f"trainer.load_checkpoint_path={step}")


# each case: (id, build(inputs, media) -> argv, the named thing, the hint); "{tmp}" = the case's folder
Build = Callable[[Inputs, Path], list[str]]
CASES: list[tuple[str, Build, str, str]] = [
    # ---- config ---------------------------------------------------------------------------------
    ("unknown key", lambda i, m: i.args("worker.rollout.temprature=0.5"),
     "worker.rollout.temprature", "did you mean 'worker.rollout.temperature'"),
    ("value of the wrong type", lambda i, m: i.args("trainer.max_steps=many"),
     "trainer.max_steps", "many"),
    ("value not among the choices", lambda i, m: i.args("algorithm.adv_estimator=grpoo"),
     "algorithm.adv_estimator='grpoo'", "did you mean 'grpo'"),
    ("batch sizes that do not divide", lambda i, m: i.args("worker.actor.micro_batch_size_per_device_for_update=3"),
     "worker.actor.micro_batch_size_per_device_for_update=3", "not a multiple of"),
    ("YAML syntax error", lambda i, m: [*i.args(), i.file("config", 'run.yaml', 'trainer:\n  max_steps: [1, 2\n')],
     "{tmp}/run.yaml", "line 3"),
    ("config file missing", lambda i, m: [*i.args(), f"config={i.tmp / 'nowhere.yaml'}"],
     "{tmp}/nowhere.yaml", "does not exist"),
    ("argument without =", lambda i, m: i.args("trainer.max_steps"),
     "'trainer.max_steps'", "key=value"),
    # ---- data files -----------------------------------------------------------------------------
    ("train file missing", lambda i, m: i.args(f"data.train_files={i.tmp / 'train.jsonl'}"),
     "data.train_files: '{tmp}/train.jsonl'", "does not exist"),
    ("malformed jsonl line", lambda i, m: i.args(i.file("data.train_files", 't.jsonl', '{\"problem\": \"a\"}\n' * 2 + '{oops\n')),
     "{tmp}/t.jsonl line 3: not valid JSON", "holds one row as a JSON object"),
    ("jsonl line that is no object", lambda i, m: i.args(i.file("data.train_files", 't.jsonl', '[1, 2]\n')),
     "{tmp}/t.jsonl line 1: expected a JSON object", "holds one row as a JSON object"),
    ("malformed json file", lambda i, m: i.args(i.file("data.train_files", 't.json', '[{\"problem\": \"a\"},\n {]')),
     "{tmp}/t.json line 2", "one JSON list of row objects"),
    ("damaged parquet file", lambda i, m: i.args(i.file("data.train_files", 't.parquet', 'PAR1 not really')),
     "{tmp}/t.parquet", "rewrite it"),
    ("ragged csv file", lambda i, m: i.args(i.file("data.train_files", 't.csv', 'problem,answer\na,b\nc,d,e\n')),
     "{tmp}/t.csv: not a readable CSV file", "the header's number of comma-separated fields"),
    ("damaged arrow file", lambda i, m: i.args(i.file("data.train_files", 't.arrow', 'ARROW1 not really')),
     "{tmp}/t.arrow: not a readable Arrow file", "save_to_disk"),
    ("data file of a format mmrl does not read", lambda i, m: i.args(i.file("data.train_files", 't.txt', 'a\nb\n')),
     "data.train_files: '{tmp}/t.txt' (.txt) is not a data format mmrl reads",
     ".jsonl, .json, .csv, .parquet or .arrow file, a `datasets` save_to_disk folder"),
    ("split that a saved dataset lacks", lambda i, m: i.args(f"data.train_files={_saved_dataset(i)}@validation"),
     "{tmp}/saved: no split 'validation'", "it has ['test', 'train']"),
    ("empty train file", lambda i, m: i.args(i.file("data.train_files", 't.jsonl', '')),
     "{tmp}/t.jsonl' has no rows", "at least one prompt"),
    ("malformed val file", lambda i, m: i.args(i.file("data.val_files", 'v.jsonl', '{}\n{\"a\": }\n')),
     "{tmp}/v.jsonl line 2: not valid JSON", "holds one row as a JSON object"),
    ("a row without the prompt column", lambda i, m: i.train(_with_row(i, 5, {"answer": "red", "images": []})),
     "{tmp}/train.jsonl row 5: no column 'problem' (data.prompt_key)", "set data.prompt_key"),
    ("prompt_key naming no column", lambda i, m: i.args("data.prompt_key=question"),
     "train.jsonl row 0: no column 'question' (data.prompt_key)", "'problem'"),
    ("a row without the answer column", lambda i, m: i.train(_with_row(i, 9, {k: v for k, v in _row(i, 9).items() if k != "answer"})),
     "{tmp}/train.jsonl row 9: no column 'answer' (data.answer_key)", "add the column to every row"),
    ("images without a marker", lambda i, m: i.train(_with_row(i, 0, _row(i, problem="What colour?"))),
     "{tmp}/train.jsonl row 0", "put one marker where each goes"),
    # ---- media ----------------------------------------------------------------------------------
    ("image file missing (row 10, past the sample)", lambda i, m: i.train(_with_row(i, 10, _row(i, 10, images=["images/gone.png"]))),
     "{tmp}/train.jsonl row 10: image file", "data.skip_bad_samples=true"),
    ("file that is no image", lambda i, m: i.train(_with_row(i, 7, _row(i, 7, images=[str(m / "noise.png")]))),
     "row 7: cannot decode image", "fix or replace the file"),
    ("truncated image", lambda i, m: i.train(_with_row(i, 1, _row(i, 1, images=[str(m / "truncated.png")]))),
     "row 1: cannot decode image", "fix or replace the file"),
    ("image too thin", lambda i, m: i.train(_with_row(i, 0, _row(i, images=[str(m / "thin.png")]))),
     "thin.png': 2×600 has an aspect ratio over 200", "fix or replace the file"),
    ("unreadable video", lambda i, m: i.train([{"problem": "<video>?", "answer": "a", "videos": [str(m / "noise.mp4")]}] * 4),
     "row 0: cannot decode video", "fix or replace the file"),
    ("video without frames", lambda i, m: i.train([{"problem": "<video>?", "answer": "a", "videos": [str(m / "frameless.mkv")]}] * 4),
     "frameless.mkv' has no decodable frames", "fix or replace the file"),
    ("audio for a model that hears nothing", lambda i, m: i.train([{"problem": "<audio>?", "answer": "a", "audios": [str(m / "silence.wav")]}] * 4),
     "row 0: the sample has 1 audio(s) in column 'audios'", "takes no audios"),
    ("unreadable audio", lambda i, m: _omni_audio(i, m, "noise.wav"),
     "row 0: cannot decode audio", "fix or replace the file"),
    ("audio without samples", lambda i, m: _omni_audio(i, m, "empty.wav"),
     "empty.wav' is empty (zero samples)", "data.skip_bad_samples=true"),
    # ---- templates ------------------------------------------------------------------------------
    ("format prompt syntax error", lambda i, m: i.args(i.file("data.format_prompt", 'p.jinja', '{{ content }}\n{% if %}')),
     "data.format_prompt: template '{tmp}/p.jinja' line 2", "fix the template"),
    ("format prompt with an undefined name", lambda i, m: i.args(i.file("data.format_prompt", 'p.jinja', '{{ content }} {{ hint }}')),
     "row 0: data.format_prompt '{tmp}/p.jinja' failed: 'hint' is undefined", "the row's columns"),
    ("format prompt missing", lambda i, m: i.args(f"data.format_prompt={i.tmp / 'p.jinja'}"),
     "data.format_prompt: template '{tmp}/p.jinja'", "does not exist"),
    ("chat template syntax error", lambda i, m: i.args(i.file("data.override_chat_template", 'chat.jinja', '{% for m in messages %}')),
     "chat template {tmp}/chat.jinja", "(data.override_chat_template)"),
    # ---- reward file ----------------------------------------------------------------------------
    ("reward file missing", lambda i, m: i.args(f"worker.reward.reward_function={i.tmp / 'r.py'}:score"),
     "worker.reward.reward_function: file '{tmp}/r.py'", "does not exist"),
    ("reward function not in the file", lambda i, m: i.args(f"worker.reward.reward_function={FINGERPRINT_REWARD}:score"),
     "`score` is not defined in", "compute_score"),
    ("reward function without an inputs parameter", lambda i, m: i.args(i.file("worker.reward.reward_function", 'r.py', 'def score():\n    return []\n') + ":score"),
     "`score` in {tmp}/r.py takes no positional argument", "def score(reward_inputs, **kwargs)"),
    ("reward file importing a missing package", lambda i, m: i.args(i.file("worker.reward.reward_function", 'r.py', 'import grading_kit\n') + ":score"),
     "Importing reward file {tmp}/r.py failed with ModuleNotFoundError", "Install `grading_kit`"),
    ("reward file with a syntax error", lambda i, m: i.args(i.file("worker.reward.reward_function", 'r.py', 'def score(x):\nreturn x\n') + ":score"),
     "Importing reward file {tmp}/r.py failed with IndentationError", "line 2"),
    ("reward kwargs the function does not take", lambda i, m: i.args("worker.reward.reward_function_kwargs.weight=2"),
     "reward_function_kwargs has ['weight']", "its keyword parameters are"),
    # ---- model folder ---------------------------------------------------------------------------
    ("model folder missing", lambda i, m: i.args(f"worker.actor.model.model_path={i.tmp / 'model'}"),
     "worker.actor.model.model_path: '{tmp}/model' does not exist", "Hugging Face model folder"),
    ("model folder without config.json", lambda i, m: i.args(f"worker.actor.model.model_path={i.model_copy(drop=('config.json',))}"),
     "'{tmp}/model' has no config.json", "save_pretrained"),
    ("model_type transformers does not know", lambda i, m: i.args(f"worker.actor.model.model_path={i.model_copy(config={'model_type': 'qwen9_vl'})}"),
     "cannot read '{tmp}/model/config.json'", "check its model_type"),
    ("model_type mmrl has no family for", lambda i, m: i.args(f"worker.actor.model.model_path={i.model_copy(config={'model_type': 'bert'})}"),
     "mmrl has no model family for model_type 'bert'", "Add a family"),
    ("model folder without processor files", lambda i, m: i.args(f"worker.actor.model.model_path={i.model_copy(drop=('*processor*',))}"),
     "train.jsonl row 0: the sample has 1 image(s)", "has its processor files"),
    ("model folder without a tokenizer", lambda i, m: i.args(f"worker.actor.model.model_path={i.model_copy(drop=('tokenizer*',))}"),
     "worker.actor.model.model_path: '{tmp}/model' has no tokenizer files", "copy them from the base model"),
    # ---- output and checkpoint paths ------------------------------------------------------------
    ("checkpoint path that is a file", lambda i, m: i.args(i.file("trainer.save_checkpoint_path", 'out', '')),
     "trainer.save_checkpoint_path: '{tmp}/out'", "choose another path"),
    ("checkpoint path inside a file", lambda i, m: i.args(i.file("trainer.save_checkpoint_path", 'out', '') + "/run"),
     "'{tmp}/out/run' cannot be a checkpoint folder: it would be made inside '{tmp}/out'", "move the file away"),
    ("resume path that is no checkpoint", lambda i, m: i.args(f"trainer.load_checkpoint_path={i.tmp}"),
     "trainer.load_checkpoint_path: '{tmp}' is no mmrl checkpoint", "global_step_N"),
    ("resume checkpoint carrying a command", lambda i, m: _tampered_checkpoint(i),
     "{tmp}/global_step_2/actor/extra_state_rank0.pt was refused", "GLOBAL posix.system"),
    ("resume path missing", lambda i, m: i.args(f"trainer.load_checkpoint_path={i.tmp / 'global_step_9'}"),
     "trainer.load_checkpoint_path: folder '{tmp}/global_step_9'", "does not exist"),
    # ---- prompt lengths -------------------------------------------------------------------------
    ("every prompt over max_prompt_length", lambda i, m: i.args("data.max_prompt_length=20"),
     "data.train_files: 0 usable prompts, fewer than 4", "raise data.max_prompt_length (42 keeps every prompt)"),
    ("overlong prompts without the filter", lambda i, m: i.args("data.max_prompt_length=20", "data.filter_overlong_prompts=false"),
     "32 of 32 prompts are longer than data.max_prompt_length=20", "data.filter_overlong_prompts=true"),
    ("fewer prompts than a step draws", lambda i, m: i.args("data.rollout_batch_size=64", "worker.actor.global_batch_size=64"),
     "data.train_files: 32 usable prompts, fewer than 64", "lower data.rollout_batch_size"),
    ("code sandbox that cannot run here", lambda i, m: i.args("worker.reward.code.enable=true", "worker.reward.code.sandbox.python=/bin/false"),
     "worker.reward.code.sandbox: the code sandbox (isolation=namespaces, python=/bin/false) cannot run a trivial program here",
     "or set isolation: process"),
]  # fmt: skip


def _case(name: str, build, named: str, hint: str):
    """A sandbox case starts a sandboxed process: it runs in the pytest-xdist worker of the tests that
    count those on the machine."""
    return pytest.param(
        build, named, hint, id=name, marks=[pytest.mark.shares("sandbox")] * ("sandbox" in name)
    )


@pytest.mark.parametrize(("build", "named", "hint"), [_case(*case) for case in CASES])
def test_broken_input_exits_2_with_one_message(inputs, media, capsys, build, named, hint):
    argv = build(inputs, media)
    started = time.perf_counter()
    code = main(argv)
    seconds = time.perf_counter() - started
    out, err = capsys.readouterr()
    assert code == 2, err[-3000:]
    assert named.format(tmp=inputs.tmp) in err, err
    assert hint in err, err
    assert "Traceback" not in out + err
    assert err.startswith("mmrl: ") and err.count("mmrl: ") == 1, err  # one message
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    assert seconds < MAX_CASE_S
    assert not (inputs.tmp / "run").exists()  # nothing was written


def test_the_valid_run_passes_preflight(inputs):
    """The inputs the cases break are fine as they are."""
    preflight(load_config(inputs.args()))


def test_a_csv_train_file_passes_preflight(inputs):
    """A new user's train.csv (a format EasyR1 reads through `datasets`) loads like the jsonl rows."""
    import pyarrow as pa
    import pyarrow.csv

    rows = [{**row, "images": row["images"][0]} for row in inputs.rows()]  # a CSV cell holds no list
    pa.csv.write_csv(pa.Table.from_pylist(rows), inputs.tmp / "train.csv")
    preflight(
        load_config(
            inputs.args(f"data.train_files={inputs.tmp / 'train.csv'}", f"data.media_dir={inputs.data}")
        )
    )


# Qwen3.5's linear attention carries a state along each sequence: a layout that splits a sequence over
# ranks is refused while the config loads, naming the keys (each case: extra overrides, the keys named)
SEQUENCE_STATE_CASES = {
    "Ulysses": (("worker.actor.ulysses_size=2",), ("worker.actor.ulysses_size=1 and worker.actor.ring_size=1",)),
    "the critic's ring": (
        ("algorithm.adv_estimator=gae", "worker.critic.ring_size=2", "worker.critic.global_batch_size=4"),
        ("worker.critic.ulysses_size=1 and worker.critic.ring_size=1",),
    ),
}  # fmt: skip


@pytest.mark.parametrize(("extra", "fixes"), SEQUENCE_STATE_CASES.values(), ids=SEQUENCE_STATE_CASES)
def test_qwen3_5_layouts_that_split_a_sequence_exit_2_at_load(
    inputs, tiny_qwen3_5_path, capsys, extra, fixes
):
    argv = inputs.args(f"worker.actor.model.model_path={tiny_qwen3_5_path}", *extra)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("mmrl: invalid configuration") and err.count("mmrl: ") == 1, err
    assert err.count("is a qwen3_5 model, whose linear-attention (gated delta net) layers carry a state") == 1
    assert f"worker.actor.model.model_path: '{tiny_qwen3_5_path}'" in err, err
    assert all(fix in err for fix in fixes), err
    assert "Traceback" not in out + err
    assert not (inputs.tmp / "run").exists()


def test_qwen3_5_with_the_default_shared_prompts_loads_and_packs_each_prompt_with_its_response(
    inputs, tiny_qwen3_5_path, tiny_vl_path
):
    """Shared prompts are an optimisation: for a model that must see every sequence whole they are not
    used (each response packed after its own prompt), where the Qwen2.5-VL keeps them."""
    from mmrl.models.loading import load_model
    from mmrl.workers.forward import prompts_shared

    load_config(inputs.args(f"worker.actor.model.model_path={tiny_qwen3_5_path}"))  # share_prompts=true
    assert not prompts_shared(load_model(str(tiny_qwen3_5_path)), True)
    assert prompts_shared(load_model(str(tiny_vl_path)), True)
    assert not prompts_shared(load_model(str(tiny_vl_path)), False)


@pytest.mark.parametrize("clip", ["tone_8k.wav", "silence.wav"])
def test_audio_at_another_rate_or_silent_is_no_error(inputs, media, clip):
    """An 8 kHz clip is resampled to the feature extractor's 16 kHz, and silence is valid audio."""
    preflight(load_config(_omni_audio(inputs, media, clip)))


def _terminal(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "MMRL_DEBUG": "0"}
    return warm.run(
        [sys.executable, "-m", "mmrl.trainer.main", *argv],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


# two that fail while the config loads (fast), one that fails in preflight (imports torch and transformers)
@pytest.mark.parametrize("case", ["YAML syntax error", "config file missing", "truncated image"])
def test_no_traceback_reaches_the_terminal(inputs, media, case):
    _, build, named, hint = next(c for c in CASES if c[0] == case)
    run = _terminal(build(inputs, media))
    assert run.returncode == 2, run.stderr[-3000:]
    assert named.format(tmp=inputs.tmp) in run.stderr and hint in run.stderr
    assert "Traceback" not in run.stdout + run.stderr
    assert not (inputs.tmp / "run").exists()


def test_debug_flag_shows_the_traceback(inputs):
    run = _terminal([*inputs.args(), inputs.file("config", "run.yaml", "trainer: [\n"), "--debug"])
    assert run.returncode == 2
    assert "Traceback (most recent call last)" in run.stderr and 'loading.py", line' in run.stderr
    assert run.stderr.index("is not valid YAML") > run.stderr.index("Traceback")  # the message comes last


def test_debug_environment_variable_shows_the_traceback(inputs, media, capsys, monkeypatch):
    monkeypatch.setenv("MMRL_DEBUG", "1")
    truncated = _with_row(inputs, 1, _row(inputs, 1, images=[str(media / "truncated.png")]))
    assert main(inputs.train(truncated)) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "row 1: cannot decode image" in err


def test_failure_during_training_exits_1_with_a_message(inputs, capsys, monkeypatch):
    """An error the trainer did not turn into a message: exit 1, its type and text, no traceback unless
    debugging (then it propagates as it is)."""
    import mmrl.trainer.ray_trainer as ray_trainer

    def failing_run(config):
        raise RuntimeError("the interconnect went away")

    monkeypatch.setattr(ray_trainer, "run", failing_run)
    assert main(inputs.args()) == 1
    err = capsys.readouterr().err
    assert "mmrl: training failed with RuntimeError: the interconnect went away" in err
    assert "rerun with --debug or MMRL_DEBUG=1 for the traceback" in err and "Traceback" not in err
    with pytest.raises(RuntimeError, match="interconnect"):
        main([*inputs.args(), "--debug"])
