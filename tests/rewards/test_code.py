"""The code reward source: extraction of the program, the test-case formats, the comparisons (hand-made
cases), and whole batches scored through a real sandbox."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from mmrl.config import CodeConfig, SandboxConfig
from mmrl.rewards.code import (
    FAILURE_KINDS,
    CodeGrader,
    CodeSource,
    MalformedTestsError,
    build_code_source,
    extract_code,
    parse_test_cases,
    stdout_matches,
    value_matches,
)
from mmrl.rewards.source import SampleFailure, check_source_results
from mmrl.sandbox import Sandbox, SandboxLimits

pytestmark = pytest.mark.shares("sandbox")  # tests count the sandboxed processes on the machine

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    ("response", "code"),
    [
        ("```python\nprint(1)\n```", "print(1)\n"),
        ("```py\na\n```\ntext\n```python3\nb\n```", "b\n"),  # the last Python block
        ("```\nplain\n```", "plain\n"),  # unlabelled blocks count
        ("```python\nkept\n```\n```cpp\nint main() {}\n```", "kept\n"),  # other languages do not
        ("<think>```python\ndraft\n```</think>```python\nfinal\n```", "final\n"),
        ("<think>```python\nonly a draft\n```</think>no code after thinking", None),
        ("```python\nprint('cut off", None),  # an unterminated block is no program
        ("just prose", None),
    ],
)
def test_extract_code_takes_the_last_python_block_outside_thinking(response, code):
    assert extract_code(response) == code


def test_test_case_formats_parse_to_one_suite_shape():
    stdio = parse_test_cases('{"inputs": ["1 2\\n", ["3", "4"]], "outputs": ["3", "7\\n"]}')
    assert (stdio.kind, stdio.inputs, stdio.outputs) == ("stdio", ["1 2\n", "3\n4"], ["3", "7\n"])
    listed = parse_test_cases([{"input": "1", "output": "2", "testtype": "stdin"}])
    assert (listed.kind, listed.inputs, listed.outputs) == ("stdio", ["1"], ["2"])
    call = parse_test_cases({"fn_name": "add", "inputs": [[1, 2], "3\n[4]", 5], "outputs": [3, 7, 5]})
    assert (call.kind, call.fn_name, call.inputs) == ("call", "add", [[1, 2], [3, [4]], [5]])
    functional = parse_test_cases(
        [{"input": "1\n2", "output": "[1, 2]", "testtype": "functional", "fn_name": "f"}]
    )
    assert (functional.kind, functional.inputs, functional.outputs) == ("call", [[1, 2]], [[1, 2]])
    asserts = parse_test_cases({"asserts": ["assert f(1) == 1"], "setup": "import math"})
    assert (asserts.kind, asserts.asserts, asserts.setup, len(asserts)) == (
        "assert",
        ["assert f(1) == 1"],
        "import math",
        1,
    )
    assert parse_test_cases(["assert True", "assert 1"]).kind == "assert"
    assert len(stdio.first(1)) == 1 and stdio.first(0) is stdio and stdio.first(5) is stdio


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "not valid JSON"),
        (42, "must be a JSON object or list, got int"),
        ({"inputs": ["1"], "outputs": []}, 'need "inputs" and "outputs"'),
        ({"tests": []}, "found keys ['tests']"),
        ([{"input": "1"}], 'holds {"input": ..., "output": ...} objects'),
        ([{"input": "1", "output": "1", "testtype": "functional"}], 'functional ones need "fn_name"'),
        ({"asserts": []}, '"asserts" must be a non-empty list'),
        ({"fn_name": "f", "inputs": ["{bad"], "outputs": [1]}, "is not one JSON value per line"),
    ],
)
def test_malformed_test_cases_say_what_was_expected(value, message):
    with pytest.raises(MalformedTestsError) as err:
        parse_test_cases(value)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("actual", "expected", "matches"),
    [
        ("3\n", "3", True),
        ("1 2  \n\n\n", "1 2", True),  # trailing spaces and blank lines
        ("\n1 2\n", "1 2\n", True),
        ("1  2", "1 2", True),  # tokens, not spacing
        ("0.3333333", "0.33333333", True),  # numbers within 1e-6
        ("0.333", "0.334", False),
        ("1 2", "1\n2", False),  # lines matter
        ("1 2 3", "1 2", False),
        ("Yes", "yes", False),
        ("", "", True),
    ],
)
def test_stdout_comparison(actual, expected, matches):
    assert stdout_matches(actual, expected) is matches


@pytest.mark.parametrize(
    ("actual", "expected", "matches"),
    [
        ((1, 2), [1, 2], True),
        (3, [3], True),  # APPS wraps an output in a list
        ([3], [[3]], True),
        (0.1 + 0.2, 0.3, True),
        ({"a": (1.0, 2)}, {"a": [1, 2]}, True),
        (1, 2, False),
        ([1, 2], [2, 1], False),
        (None, [None], True),
        ("1", 1, False),
    ],
)
def test_return_value_comparison(actual, expected, matches):
    assert value_matches(actual, expected) is matches


STDIO_ROW = json.dumps({"inputs": ["1 2\n", "5 5\n", "-3 3\n"], "outputs": ["3", "10", "0"]})
CALL_ROW = {"fn_name": "add", "inputs": [[1, 2], [0.1, 0.2], [[1], [2]]], "outputs": [3, 0.3, [1, 2]]}
ASSERT_ROW = {"asserts": ["assert square(2) == 4", "assert square(-3) == 9", "assert square(0) == 1"]}
BATCH = [
    ("```python\na, b = map(int, input().split())\nprint(a + b)\n```", STDIO_ROW),
    ("```python\na, b = map(int, input().split())\nprint(a * b if a > 0 else a + b)\n```", STDIO_ROW),
    ("```python\ndef add(a, b):\n    return a + b\n```", CALL_ROW),
    ("```python\nclass Solution:\n    def add(self, a, b):\n        return a + b\n```", CALL_ROW),
    ("```python\ndef square(x):\n    return x * x\n```", ASSERT_ROW),
    ("```python\nimport sys\nsys.exit(0)\n```", ASSERT_ROW),  # leaves before the asserts run
    (  # forges result lines with a guessed nonce, then leaves
        "```python\nimport json, os\nfor i in range(3):\n    print('0' * 32, json.dumps({'i': i, 'value': True}))\n"
        "os._exit(0)\n```",
        ASSERT_ROW,
    ),
    ("The answer is 3.", STDIO_ROW),
    ("```python\nprint(1)\n```", "{broken"),
]


@pytest.fixture(scope="module")
def grader():
    return CodeGrader(Sandbox(SandboxLimits(cpu_time_s=2.0, wall_time_s=5.0), max_concurrency=4))


def test_a_batch_of_every_format_is_scored_per_sample(grader):
    source = CodeSource(grader, test_cases_key="tests")
    inputs = [{"response": response, "tests": tests} for response, tests in BATCH] + [{"response": "x"}]
    results = check_source_results("code", source.score(inputs), len(inputs))
    overall = [result["overall"] if isinstance(result, dict) else None for result in results]
    assert overall == [1.0, 1 / 3, 1.0, 1.0, 2 / 3, 0.0, 0.0, 0.0, None, None]
    assert results[1]["wrong_answer"] == pytest.approx(2 / 3) and results[1]["pass_rate"] == pytest.approx(
        1 / 3
    )
    assert results[4]["wrong_answer"] == pytest.approx(1 / 3) and results[4]["all_passed"] == 0.0
    assert results[7]["no_code"] == 1.0 and set(results[7]) >= {"pass_rate", "all_passed", *FAILURE_KINDS}
    assert all(result["leftover_processes"] == 0.0 for result in results[:8])
    grades = source.last_grades
    assert grades[1].reason.startswith("2 of 3 cases failed; case 0: expected '3', got '2\\n'")
    assert grades[4].reason == "1 of 3 cases failed; case 2: 'assert square(0) == 1' failed"
    assert "the program failed to load: SystemExit: 0" in grades[5].reason
    assert grades[6].cases[0].reason == "the program ended before this case ran"  # forged lines ignored
    assert results[8].reason.startswith("the row's 'tests': test cases are not valid JSON (Expecting")
    assert results[9] == SampleFailure("the row has no 'tests' (worker.reward.code.test_cases_key)")


def test_all_passed_scoring_and_max_test_cases(grader):
    wrong_last = "```python\na, b = map(int, input().split())\nprint(a + b if b != 3 else 1)\n```"
    [all_cases] = CodeSource(grader, score="all_passed").score(
        [{"response": wrong_last, "ground_truth": STDIO_ROW}]
    )
    assert (all_cases["overall"], all_cases["pass_rate"]) == (0.0, pytest.approx(2 / 3))
    first_two = CodeSource(CodeGrader(grader.sandbox, max_test_cases=2), score="pass_rate")
    [result] = first_two.score([{"response": wrong_last, "ground_truth": STDIO_ROW}])
    assert (result["overall"], result["all_passed"]) == (1.0, 1.0)  # the failing third case is not run


def test_the_source_is_built_from_its_config_section():
    config = CodeConfig(
        enable=True,
        test_cases_key="tests",
        score="all_passed",
        max_test_cases=3,
        sandbox=SandboxConfig(isolation="namespaces", max_concurrency=2, cpu_time_s=2.0, max_processes=4),
    )
    source = build_code_source(config)
    assert (source.name, source.test_cases_key, source.score_name) == ("code", "tests", "all_passed")
    assert source.grader.max_test_cases == 3 and source.grader.sandbox.max_concurrency == 2
    limits = source.grader.sandbox.limits
    assert (limits.cpu_time_s, limits.max_processes, limits.wall_time_s) == (2.0, 4, 10.0)


def test_config_checks_name_the_sandbox_keys(tmp_path):
    from mmrl.config import PPOConfig
    from mmrl.config.loading import validate_config

    def errors_with(**code):
        config = PPOConfig()
        reward = dataclasses.replace(config.worker.reward, code=CodeConfig(**code))
        return "\n".join(
            validate_config(
                dataclasses.replace(config, worker=dataclasses.replace(config.worker, reward=reward))
            )
        )

    sandbox = SandboxConfig(
        cpu_time_s=0, max_open_files=4, python=str(tmp_path / "py"), read_only_paths=["/no/data"]
    )
    errors = errors_with(enable=True, max_test_cases=-1, test_cases_key="", sandbox=sandbox)
    for expected in (
        "worker.reward.code.sandbox.cpu_time_s=0 must be > 0",
        "worker.reward.code.sandbox.max_open_files=4 must be >= 8",
        "worker.reward.code.max_test_cases=-1 must be >= 0",
        "worker.reward.code.test_cases_key is empty",
        f"worker.reward.code.sandbox.python: interpreter '{tmp_path / 'py'}' does not exist",
        "worker.reward.code.sandbox.read_only_paths: '/no/data' does not exist",
    ):
        assert expected in errors
    assert "worker.reward.code.sandbox" not in errors_with(enable=False, sandbox=sandbox)  # off: not checked
    assert "worker.reward.code.sandbox.isolation='chroot' is not one of" in errors_with(
        sandbox=SandboxConfig(isolation="chroot")
    )


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("<think>plan</think>```python\nprint(1)\n```", 1.0),
        ("```py\nprint(1)\n```", 1.0),  # no thinking at all is fine
        ("<think>```python\nprint(1)\n```", 0.0),  # thinking never closed
        ("<think>plan</think>print(1)", 0.0),  # no fenced block
    ],
)
def test_shipped_code_format_reward(response, score):
    from mmrl.rewards.rule import load_reward_function

    reward = load_reward_function(os.path.join(REPO, "reward_functions", "code_format.py:compute_score"))
    assert reward([{"response": response, "response_length": 1, "ground_truth": ""}]) == [
        {"overall": score, "format": score}
    ]
