"""Tests for the reward-function plug-in contract and the shipped reward files."""

from __future__ import annotations

import ast
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

from mmrl.rewards.rule import (
    RewardFunction,
    RewardFunctionError,
    build_reward_inputs,
    load_reward_function,
    reduce_reward_metrics,
)

ASSETS = Path(__file__).parent / "assets"
REPO_ROOT = Path(__file__).parents[2]
REWARD_FUNCTIONS = REPO_ROOT / "reward_functions"
# EasyR1's own example reward files, verbatim (tests/fixtures/easyr1/SOURCE.md; math.py needs mmrl[easyr1])
EASYR1_REWARDS = REPO_ROOT / "tests" / "fixtures" / "easyr1" / "examples" / "reward_function"


def _inputs(*responses: str, ground_truth: str = "2") -> list[dict]:
    return build_reward_inputs(
        list(responses), [len(r) for r in responses], [ground_truth] * len(responses), extra_columns={}
    )


def _load(name: str, function: str, **kwargs) -> RewardFunction:
    return load_reward_function(f"{ASSETS / name}:{function}", kwargs)


# ---------------------------------------------------------------- loading


def test_load_relative_path_resolves_against_cwd(monkeypatch):
    monkeypatch.chdir(EASYR1_REWARDS.parent)
    reward = load_reward_function("reward_function/math.py:compute_score", None)
    assert reward.path == str(EASYR1_REWARDS / "math.py")
    assert (reward.name, reward.reward_type, reward.reward_name, reward.kwargs) == (
        "compute_score",
        "batch",
        "math",
        {},
    )


def test_load_absolute_path_and_default_function_name_main():
    reward = load_reward_function(str(ASSETS / "default_main.py"), None)
    assert reward.name == "main"
    assert reward.reward_type == "batch"  # no REWARD_TYPE in the file: EasyR1's default
    assert reward.reward_name == "default_main"
    assert reward(_inputs("abc", "hello")) == [{"overall": 3.0}, {"overall": 5.0}]


def test_kwargs_are_passed_to_every_call():
    reward = _load("faulty_batch.py", "scaled", scale=2.0, bonus=0.5)
    scores = reward(build_reward_inputs(["a", "b"], [3, 10], ["x", "y"], {}))
    assert scores == [{"overall": 6.5}, {"overall": 20.5}]


def test_unknown_kwarg_fails_at_load_naming_the_parameters():
    with pytest.raises(RewardFunctionError) as info:
        _load("faulty_batch.py", "scaled", scael=2.0)
    message = str(info.value)
    assert "['scael']" in message and "scaled" in message and "['scale', 'bonus']" in message


def test_easyr1_batch_file_works_unchanged():
    reward = load_reward_function(f"{EASYR1_REWARDS / 'math.py'}:compute_score", {"format_weight": 0.2})
    scores = reward(
        _inputs(
            "<think>1+1</think> so \\boxed{2}",  # format and answer right
            "\\boxed{2}",  # answer right, no <think>
            "< think >hmm< / think >\\boxed{3}",  # spaced tags are tolerated, answer wrong
        )
    )
    assert scores == [
        {"overall": 1.0, "format": 1.0, "accuracy": 1.0},
        {"overall": 0.8, "format": 0.0, "accuracy": 1.0},
        {"overall": 0.2, "format": 1.0, "accuracy": 0.0},
    ]


def test_easyr1_sequential_file_works_unchanged():
    reward = load_reward_function(f"{EASYR1_REWARDS / 'r1v.py'}:compute_score", None)
    assert reward.reward_type == "sequential"
    scores = reward(_inputs("<think>x</think> <answer>2</answer>", "2", "<answer>3</answer>"))
    assert scores == [
        {"overall": 1.0, "format": 1.0, "accuracy": 1.0},
        {"overall": 0.5, "format": 0.0, "accuracy": 1.0},
        {"overall": 0.0, "format": 0.0, "accuracy": 0.0},
    ]


def test_numeric_types_are_converted_to_float():
    scores = _load("faulty_batch.py", "numeric_types")(_inputs("a"))
    assert scores == [{"overall": 1.0, "count": 3.0, "ratio": 0.25, "flag": 0.0, "array": 2.5}]
    assert all(type(value) is float for value in scores[0].values())


def test_zero_dim_torch_tensor_is_accepted(tmp_path):
    (tmp_path / "tensor_reward.py").write_text(
        "import torch\n\ndef compute_score(inputs):\n"
        "    return [{'overall': torch.tensor(0.75), 'accuracy': torch.tensor(1)} for _ in inputs]\n"
    )
    reward = load_reward_function(f"{tmp_path / 'tensor_reward.py'}:compute_score", None)
    assert reward(_inputs("a")) == [{"overall": 0.75, "accuracy": 1.0}]


def test_empty_batch_returns_no_scores_without_calling():
    assert _load("faulty_batch.py", "raises")([]) == []


def test_same_basename_in_two_folders_does_not_collide(tmp_path):
    for folder, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "reward.py").write_text(
            f"def compute_score(inputs):\n    return [{{'overall': {value}}} for _ in inputs]\n"
        )
    reward_a = load_reward_function(f"{tmp_path / 'a' / 'reward.py'}:compute_score", None)
    reward_b = load_reward_function(f"{tmp_path / 'b' / 'reward.py'}:compute_score", None)
    assert reward_a(_inputs("x")) == [{"overall": 1.0}]
    assert reward_b(_inputs("x")) == [{"overall": 2.0}]


def test_sibling_helpers_import_relatively_without_touching_sys_path(tmp_path):
    (tmp_path / "grading_helpers.py").write_text("BONUS = 0.25\n")
    (tmp_path / "reward.py").write_text(
        "from .grading_helpers import BONUS\n\n"
        "def compute_score(inputs):\n    return [{'overall': BONUS} for _ in inputs]\n"
    )
    sys_path_before = list(sys.path)
    reward = load_reward_function(f"{tmp_path / 'reward.py'}:compute_score", None)
    assert reward(_inputs("x")) == [{"overall": 0.25}]
    assert sys.path == sys_path_before
    assert "grading_helpers" not in sys.modules  # cached under the reward file's private package


def test_reward_file_may_define_dataclasses(tmp_path):
    # dataclasses look their module up in sys.modules while the file runs
    (tmp_path / "dataclass_reward.py").write_text(
        "from dataclasses import dataclass\n\n@dataclass\nclass Score:\n    overall: float\n\n"
        "def compute_score(inputs):\n    return [vars(Score(overall=0.5)) for _ in inputs]\n"
    )
    reward = load_reward_function(f"{tmp_path / 'dataclass_reward.py'}:compute_score", None)
    assert reward(_inputs("x")) == [{"overall": 0.5}]


def test_absolute_sibling_import_fails_with_a_hint(tmp_path):
    (tmp_path / "grading_helpers_abs.py").write_text("BONUS = 0.25\n")
    (tmp_path / "reward.py").write_text("from grading_helpers_abs import BONUS\n")
    with pytest.raises(RewardFunctionError, match=r"from \.grading_helpers_abs import") as info:
        load_reward_function(f"{tmp_path / 'reward.py'}:compute_score", None)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_missing_third_party_import_names_the_package(tmp_path):
    (tmp_path / "needs_pkg.py").write_text("from mathruler_not_installed.grader import grade_answer\n")
    with pytest.raises(RewardFunctionError, match="Install `mathruler_not_installed`") as info:
        load_reward_function(f"{tmp_path / 'needs_pkg.py'}:compute_score", None)
    assert str(tmp_path / "needs_pkg.py") in str(info.value)


def test_reward_function_pickles_by_reloading_its_file():
    reward = _load("faulty_batch.py", "scaled", scale=3.0)
    restored = pickle.loads(pickle.dumps(reward))
    assert (restored.path, restored.name, restored.kwargs) == (reward.path, "scaled", {"scale": 3.0})
    assert restored(build_reward_inputs(["a"], [2], ["x"], {})) == [{"overall": 6.0}]


# ---------------------------------------------------------------- loading errors


def test_missing_file_names_path_and_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardFunctionError) as info:
        load_reward_function("rewards/nope.py:compute_score", None)
    message = str(info.value)
    assert "'rewards/nope.py'" in message
    assert str(tmp_path / "rewards" / "nope.py") in message
    assert f"current directory {tmp_path}" in message


def test_missing_function_lists_the_functions_defined():
    with pytest.raises(RewardFunctionError) as info:
        _load("faulty_sequential.py", "compute_score")
    message = str(info.value)
    assert "`compute_score` is not defined" in message and str(ASSETS / "faulty_sequential.py") in message
    assert "['fails_on_empty_answer', 'returns_list']" in message


def test_non_callable_attribute_is_rejected():
    with pytest.raises(RewardFunctionError, match="`NOT_A_FUNCTION` is not callable"):
        _load("faulty_sequential.py", "NOT_A_FUNCTION")


def test_bad_reward_type_is_rejected():
    with pytest.raises(RewardFunctionError) as info:
        _load("bad_reward_type.py", "compute_score")
    assert "REWARD_TYPE = 'stream'" in str(info.value) and "['batch', 'sequential']" in str(info.value)


@pytest.mark.parametrize("spec", ["", "   ", "reward.py:not-a-name"])
def test_malformed_spec_is_rejected(spec):
    with pytest.raises(RewardFunctionError, match="reward_function|function name"):
        load_reward_function(spec, None)


# ---------------------------------------------------------------- call-time errors


def test_wrong_batch_length_names_file_and_lengths():
    with pytest.raises(RewardFunctionError) as info:
        _load("faulty_batch.py", "wrong_length")(_inputs("a", "b", "c"))
    message = str(info.value)
    assert "faulty_batch.py" in message and "returned 2 scores for a batch of 3 samples" in message


def test_batch_function_returning_a_dict_suggests_sequential():
    with pytest.raises(RewardFunctionError, match='returned dict.*REWARD_TYPE = "sequential"'):
        _load("faulty_batch.py", "not_a_list")(_inputs("a", "b"))


def test_missing_overall_names_sample_and_keys_found():
    with pytest.raises(RewardFunctionError) as info:
        _load("faulty_batch.py", "missing_overall")(_inputs("a", "b", "c"))
    message = str(info.value)
    assert "faulty_batch.py" in message
    assert "without 'overall' for sample 1" in message and "['accuracy', 'format']" in message


def test_non_dict_score_is_rejected():
    with pytest.raises(RewardFunctionError, match="returned float for sample 0"):
        _load("faulty_batch.py", "not_a_dict")(_inputs("a"))


def test_sequential_function_returning_a_list_suggests_batch():
    with pytest.raises(RewardFunctionError, match='returned list for sample 0.*REWARD_TYPE = "batch"'):
        _load("faulty_sequential.py", "returns_list")(_inputs("a"))


@pytest.mark.parametrize(
    ("function", "index", "shown"),
    [("nan_score", 2, "'accuracy' = nan"), ("inf_score", 0, "'overall' = -inf")],
)
def test_non_finite_score_names_sample_key_and_value(function, index, shown):
    with pytest.raises(RewardFunctionError) as info:
        _load("faulty_batch.py", function)(_inputs("a", "b", "c"))
    message = str(info.value)
    assert "faulty_batch.py" in message and f"non-finite score for sample {index}: {shown}" in message


@pytest.mark.parametrize(
    ("function", "shown"), [("string_score", "'accuracy' = '1.0' (str)"), ("none_score", "'overall' = None")]
)
def test_non_numeric_score_names_sample_key_and_value(function, shown):
    with pytest.raises(RewardFunctionError) as info:
        _load("faulty_batch.py", function)(_inputs("a", "b"))
    assert "non-numeric score for sample 0" in str(info.value) and shown in str(info.value)


def test_exception_in_sequential_function_names_sample_and_is_chained():
    reward = _load("faulty_sequential.py", "fails_on_empty_answer")
    long_reasoning = "x" * 5000
    inputs = _inputs("answer: 2", "answer: 3", long_reasoning)
    with pytest.raises(RewardFunctionError) as info:
        reward(inputs)
    message = str(info.value)
    assert "fails_on_empty_answer" in message and str(ASSETS / "faulty_sequential.py") in message
    assert "IndexError" in message and "on sample 2 of 3" in message
    assert "'response_length': 5000" in message and "'ground_truth': '2'" in message
    assert len(message) < 1000  # the 5000-character response is cut
    assert isinstance(info.value.__cause__, IndexError)


def test_exception_in_batch_function_names_the_batch():
    with pytest.raises(RewardFunctionError) as info:
        _load("faulty_batch.py", "raises")(build_reward_inputs(["abcd"] * 2, [4, 4], ["1", "1"], {}))
    message = str(info.value)
    assert "ZeroDivisionError" in message and "on a batch of 2 samples" in message
    assert "faulty_batch.py" in message and "'response': 'abcd'" in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_in_progress_names_the_sample_or_batch_being_scored():
    """What a reward worker reports when its call outlasts worker.reward.timeout_s: the sample (or the
    batch) the running call started on."""
    sequential = _load("faulty_sequential.py", "fails_on_empty_answer")
    with pytest.raises(RewardFunctionError):
        sequential(_inputs("answer: 2", "answer: 3", "no answer"))
    assert sequential.in_progress.startswith("sample 2 of 3: {'response': 'no answer', 'response_length': 9")
    batch = _load("faulty_batch.py", "raises")
    with pytest.raises(RewardFunctionError):
        batch(build_reward_inputs(["abcd"] * 2, [4, 4], ["1", "1"], {}))
    assert batch.in_progress.startswith("a batch of 2 samples, the first {'response': 'abcd'")


def test_reward_function_error_pickles_with_its_message():
    with pytest.raises(RewardFunctionError) as info:
        _load("faulty_batch.py", "missing_overall")(_inputs("a", "b"))
    restored = pickle.loads(pickle.dumps(info.value))
    assert type(restored) is RewardFunctionError and str(restored) == str(info.value)


# ---------------------------------------------------------------- inputs and metrics


def test_build_reward_inputs_carries_extra_columns():
    inputs = build_reward_inputs(
        ["r0", "r1"],
        [np.int64(3), 4],
        np.array(["a", "b"], dtype=object),
        {
            "data_source": ["geo", "geo"],
            "images": np.array([["img0.png"], ["img1.png", "img2.png"]], dtype=object),
            "ground_truth": ["ignored", "ignored"],  # the explicit argument wins
            "score_hint": np.array([0.5, 1.5]),
        },
    )
    assert inputs == [
        {
            "response": "r0",
            "response_length": 3,
            "ground_truth": "a",
            "data_source": "geo",
            "images": ["img0.png"],
            "score_hint": 0.5,
        },
        {
            "response": "r1",
            "response_length": 4,
            "ground_truth": "b",
            "data_source": "geo",
            "images": ["img1.png", "img2.png"],
            "score_hint": 1.5,
        },
    ]
    assert type(inputs[0]["response_length"]) is int and type(inputs[0]["score_hint"]) is float


def test_build_reward_inputs_rejects_a_short_column():
    with pytest.raises(ValueError, match="'data_source' has 1 values for 2 responses"):
        build_reward_inputs(["a", "b"], [1, 1], ["x", "y"], {"data_source": ["geo"]})


def test_reduce_reward_metrics_means_every_key():
    metrics = reduce_reward_metrics(
        [
            {"overall": 1.0, "accuracy": 1.0, "format": 0.0},
            {"overall": 0.0, "accuracy": 0.0, "format": 1.0},
            {"overall": 0.5, "accuracy": 1.0, "format": 1.0, "length_penalty": -0.25},
        ]
    )
    assert metrics == pytest.approx(
        {
            "reward/overall": 0.5,
            "reward/accuracy": 2 / 3,
            "reward/format": 2 / 3,
            "reward/length_penalty": -0.25,
        }
    )
    assert reduce_reward_metrics([]) == {}


# ---------------------------------------------------------------- shipped reward files


def _shipped(name: str, **kwargs) -> RewardFunction:
    return load_reward_function(f"{REWARD_FUNCTIONS / name}:compute_score", kwargs)


def _grader_modules():
    math_reward, r1v_reward = _shipped("math.py"), _shipped("r1v.py")
    return [sys.modules[math_reward.fn.__module__], sys.modules[r1v_reward.fn.__module__]]


@pytest.mark.parametrize(
    ("given", "truth", "expected"),
    [
        ("\\frac{1}{2}", "0.5", True),
        ("\\dfrac{1}{2}", "\\frac12", True),
        ("-\\frac{3}{4}", "-0.75", True),
        ("1/2", "0.5", True),
        ("2.0", "2", True),
        ("2.50", "2.5", True),
        ("0.3333333", "\\frac{1}{3}", True),  # within 1e-6
        ("0.3333", "\\frac{1}{3}", False),
        ("1,000", "1000", True),
        ("x = 5", "5", True),
        ("30^\\circ", "30", True),
        ("$12$", "12", True),
        ("\\text{12 }", "12", True),
        ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt{3}}{2}", True),
        ("\\left(1, 2\\right)", "(1,2)", True),
        ("3", "4", False),
        ("", "0", False),
        (None, "0", False),
        ("\\frac{1}{0}", "1", False),
    ],
)
def test_math_grader_cases(given, truth, expected):
    for module in _grader_modules():  # r1v.py carries a copy of math.py's grader: both must agree
        assert module.grade_answer(given, truth) is expected, module.__name__


def test_math_boxed_extraction_handles_nested_braces_and_takes_the_last():
    module = _grader_modules()[0]
    assert (
        module.extract_boxed_content("a \\boxed{1} then \\boxed{\\frac{\\sqrt{3}}{2}}.")
        == "\\frac{\\sqrt{3}}{2}"
    )
    assert module.extract_boxed_content("no box here") is None
    assert module.extract_boxed_content("cut off \\boxed{\\frac{1}{2}") is None


def test_math_reward_scores():
    reward = _shipped("math.py")
    assert (reward.reward_name, reward.reward_type) == ("math", "batch")
    scores = reward(
        _inputs(
            "<think>half</think> The answer is \\boxed{\\frac{1}{2}}.",
            "The answer is \\boxed{0.5}",  # right, no <think>
            "<think>hmm</think> it is 0.5",  # <think> but no box: nothing to grade
            "<think>a</think>\\boxed{\\frac{1}{3}}",  # wrong
            ground_truth="0.5",
        )
    )
    assert scores == [
        {"overall": 1.0, "format": 1.0, "accuracy": 1.0},
        {"overall": 0.9, "format": 0.0, "accuracy": 1.0},
        {"overall": 0.0, "format": 0.0, "accuracy": 0.0},
        {"overall": pytest.approx(0.1), "format": 1.0, "accuracy": 0.0},
    ]
    heavy_format = _shipped("math.py", format_weight=0.5)(_inputs("\\boxed{2}", ground_truth="2"))
    assert heavy_format == [{"overall": 0.5, "format": 0.0, "accuracy": 1.0}]


@pytest.mark.parametrize(
    ("response", "format_score", "accuracy_score"),
    [
        ("<think>2 x 3</think><answer>6</answer>", 1.0, 1.0),
        ("<think>\nmulti\nline\n</think>\n\n<answer> 6.0 </answer>\n", 1.0, 1.0),
        ("<answer>6</answer>", 0.0, 1.0),  # no reasoning block
        ("<think>a</think><answer>6</answer> trailing words", 0.0, 1.0),
        ("preamble <think>a</think><answer>6</answer>", 0.0, 1.0),
        ("<think>a</think><answer>7</answer>", 1.0, 0.0),
        ("6", 0.0, 1.0),  # no tags: the whole response is graded
        ("<think>a</think><answer>\n6\n</answer>", 1.0, 1.0),  # multi-line answer content
    ],
)
def test_r1v_reward_scores(response, format_score, accuracy_score):
    reward = _shipped("r1v.py")
    assert (reward.reward_name, reward.reward_type) == ("r1v", "sequential")
    [score] = reward(_inputs(response, ground_truth="6"))
    assert score == {
        "overall": 0.5 * accuracy_score + 0.5 * format_score,
        "format": format_score,
        "accuracy": accuracy_score,
    }


@pytest.mark.parametrize(
    ("response", "truth", "format_score", "accuracy_score"),
    [
        ("red", "red", 1.0, 1.0),
        ("Red.", "red", 1.0, 1.0),
        (" red<|im_end|>", "red", 1.0, 1.0),
        ("red circle", "red", 1.0, 1.0),
        ("3", 3, 1.0, 1.0),
        ("Three!", "3", 1.0, 1.0),
        ("blue", "red", 1.0, 0.0),
        ("The shape is red.", "red", 0.0, 0.0),  # a sentence: wrong first word, too long
        ("", "red", 0.0, 0.0),
        ("light blue", "light green", 1.0, 0.0),
    ],
)
def test_shapes_reward_scores(response, truth, format_score, accuracy_score):
    reward = _shipped("shapes.py")
    assert (reward.reward_name, reward.reward_type) == ("shapes", "batch")
    [score] = reward(_inputs(response, ground_truth=truth))
    assert score == {"overall": accuracy_score, "format": format_score, "accuracy": accuracy_score}


def test_shapes_format_weight_and_max_words():
    reward = _shipped("shapes.py", format_weight=0.2, max_words=1)
    scores = reward(_inputs("red", "red circle", "blue", ground_truth="red"))
    assert [score["overall"] for score in scores] == pytest.approx([1.0, 0.8, 0.2])


def test_shipped_files_import_only_the_standard_library():
    """Users copy these files anywhere: no mmrl, no third-party grader."""
    for name in ("math.py", "r1v.py", "shapes.py"):
        tree = ast.parse((REWARD_FUNCTIONS / name).read_text())
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        }
        imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert imported <= {"__future__", "re", "typing"}, (name, imported)
        assert ast.get_docstring(tree), name


def test_relative_spec_from_repo_root(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    reward = load_reward_function("reward_functions/shapes.py:compute_score", {"format_weight": 0.0})
    assert reward.path == os.path.join(str(REPO_ROOT), "reward_functions", "shapes.py")


# ------------------------------------------------ EasyR1's example reward files (pip install mmrl[easyr1])


def test_easyr1_math_reward_scores_through_the_loader():
    """EasyR1's math.py (imports mathruler): 0.9 accuracy + 0.1 format, EasyR1's default weights."""
    reward = load_reward_function(f"{EASYR1_REWARDS / 'math.py'}:compute_score", None)
    assert (reward.reward_type, reward.reward_name) == ("batch", "math")
    scores = reward(
        _inputs(
            "<think>1/2 is 0.5</think> The answer is \\boxed{\\frac{1}{2}}",  # right, well formed
            "<think>hmm</think> \\boxed{3}",  # wrong, well formed
            "the answer is \\boxed{0.5}",  # right, no <think>
            ground_truth="0.5",
        )
    )
    assert scores == [
        {"overall": 1.0, "format": 1.0, "accuracy": 1.0},
        {"overall": pytest.approx(0.1), "format": 1.0, "accuracy": 0.0},
        {"overall": pytest.approx(0.9), "format": 0.0, "accuracy": 1.0},
    ]


def test_easyr1_r1v_reward_is_sequential():
    reward = load_reward_function(f"{EASYR1_REWARDS / 'r1v.py'}:compute_score", {"format_weight": 0.5})
    assert reward.reward_type == "sequential"
    scores = reward(_inputs("<think>x</think> <answer>2</answer>", "<answer>3</answer>", ground_truth="2"))
    assert scores == [
        {"overall": 1.0, "format": 1.0, "accuracy": 1.0},
        {"overall": 0.0, "format": 0.0, "accuracy": 0.0},
    ]


def test_easyr1_dapo_reward_takes_its_overlong_kwargs():
    """dapo.py (stdlib only): ±1 accuracy plus the soft overlong punishment, with the kwargs EasyR1's
    qwen3_14b_dapo17k_dapo.sh passes."""
    kwargs = {"max_response_length": 100, "overlong_buffer_length": 20, "overlong_penalty_factor": 1.0}
    reward = load_reward_function(f"{EASYR1_REWARDS / 'dapo.py'}:compute_score", kwargs)
    inputs = build_reward_inputs(["Answer: 7", "Answer: 8"], [10, 90], ["7", "7"], extra_columns={})
    # 90 tokens: 10 into the 20-token buffer → -(90 - 80) / 20 = -0.5
    assert reward(inputs) == [
        {"overall": 1.0, "accuracy": 1.0, "overlong": 0.0, "accuracy_normalized": 1.0},
        {"overall": -1.5, "accuracy": -1.0, "overlong": -0.5, "accuracy_normalized": 0.0},
    ]


@pytest.mark.parametrize("missing", ["mathruler", "pylatexenc"])
def test_easyr1_reward_without_mathruler_names_the_extra(missing, monkeypatch):
    """A missing grader (or the LaTeX parser it imports) names the mmrl extra that installs it."""
    for name in list(sys.modules):
        if name == missing or name.startswith(f"{missing}.") or name.startswith("mathruler"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` raises ModuleNotFoundError
    with pytest.raises(RewardFunctionError, match=r"pip install 'mmrl\[easyr1\]'") as info:
        load_reward_function(f"{EASYR1_REWARDS / 'math.py'}:compute_score", None)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


# ---------------------------------------------------------------- overlong shaping (reward worker)


def test_reward_scorer_adds_the_overlong_penalty_to_every_reward(tiny_vl_path):
    import torch
    from transformers import AutoTokenizer

    from mmrl.config import RewardConfig
    from mmrl.protocol import DataProto
    from mmrl.rewards.scorer import RewardScorer
    from mmrl.workers.reward_worker import score_in_process

    # data.max_response_length 20, buffer 4, factor 0.5 (L = valid tokens):
    #   L 3, 16: 0 (up to 20 - 4 = 16); 17: (16 - 17) / 4 * 0.5 = -0.125; 18: -0.25; 20 (end): -0.5
    lengths = [3, 16, 17, 18, 20]
    response_mask = (torch.arange(20) < torch.tensor(lengths)[:, None]).long()
    responses = torch.randint(50, 300, (5, 20), generator=torch.Generator().manual_seed(0)) * response_mask
    batch = DataProto.from_dict(
        tensors={"responses": responses, "response_mask": response_mask},
        non_tensors={"ground_truth": np.array(["7"] * 5, dtype=object)},
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_vl_path)
    spec = f"{REWARD_FUNCTIONS / 'math.py'}:compute_score"  # junk responses: accuracy and format 0
    expected = [0.0, 0.0, -0.125, -0.25, -0.5]
    reward = RewardConfig(reward_function=spec, overlong_buffer_length=4, overlong_penalty_factor=0.5)
    config = _scorer_config(tiny_vl_path, reward)
    scored = score_in_process(RewardScorer(config), batch, tokenizer, config)
    scores = scored.non_tensor_batch["reward_scores"]
    assert [score["overlong_penalty"] for score in scores] == pytest.approx(expected)
    assert [score["overall"] for score in scores] == pytest.approx(expected)
    assert [score["accuracy"] for score in scores] == [0.0] * 5  # sub-scores untouched
    token_level = scored.batch["token_level_scores"]
    assert token_level.sum(-1).tolist() == pytest.approx(expected)
    assert token_level[4, 19] == pytest.approx(-0.5) and token_level[2, 16] == pytest.approx(-0.125)
    assert reduce_reward_metrics(list(scores))["reward/overlong_penalty"] == pytest.approx(sum(expected) / 5)
    # the texts scored and logged are the valid tokens decoded
    texts = [
        tokenizer.decode(row[:n].tolist(), skip_special_tokens=True) for row, n in zip(responses, lengths)
    ]
    assert list(scored.non_tensor_batch["response_text"]) == texts

    off_config = _scorer_config(tiny_vl_path, RewardConfig(reward_function=spec))
    off = score_in_process(RewardScorer(off_config), batch, tokenizer, off_config)
    assert all("overlong_penalty" not in score for score in off.non_tensor_batch["reward_scores"])
    assert off.batch["token_level_scores"].abs().sum() == 0


def _scorer_config(model_path, reward):
    """A run's config for a reward scorer: the model ``model_path``, 20-token responses."""
    from mmrl.config import ActorConfig, ActorModelConfig, DataConfig, PPOConfig, WorkerConfig

    actor = ActorConfig(model=ActorModelConfig(model_path=str(model_path)))
    return PPOConfig(data=DataConfig(max_response_length=20), worker=WorkerConfig(actor=actor, reward=reward))
