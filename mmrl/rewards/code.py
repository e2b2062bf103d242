"""Code execution as a reward source (``code``): run the response's program against the row's tests.

The response's last fenced Python block (```` ```python ```` / ```` ```py ```` / unlabelled; text in
``<think>...</think>`` is ignored) runs in :class:`mmrl.sandbox.Sandbox` against the test cases in
the reward input's ``test_cases_key`` (a JSON string, or the parsed value), in one of three formats:

- **stdin/stdout** (APPS, TACO, CodeContests, sandbox-fusion, Skywork-OR1):
  ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}``, or a list of
  ``{"input": ..., "output": ..., "testtype": "stdin"}``. One sandboxed run per case; the output
  matches when its lines match after trailing whitespace is dropped, token by token, numbers within
  1e-6 (relative or absolute).
- **call** (LeetCode style, APPS' ``fn_name``): ``{"fn_name": "add", "inputs": [[1, 2], ...],
  "outputs": [3, ...]}``; ``fn_name`` may be a function or a method of ``class Solution``; an input is
  the list of arguments (or a string of one JSON value per line, as LiveCodeBench writes them). All
  cases run in one sandboxed program; each return value is compared with the expected one (tuples as
  lists, floats within 1e-6, an expected ``[x]`` also accepts ``x``) outside the sandbox.
- **assert** (MBPP, HumanEval-style): ``{"asserts": ["assert add(1, 2) == 3", ...], "setup": "..."}``
  or a plain list of ``assert`` lines; each statement is one case, run after the program (and setup).

The expected outputs of stdin/stdout and call cases never enter the sandbox. Call and assert cases
run in the same interpreter as the program; their results are reported on lines tagged with a
random nonce read from stdin, so a program that exits early (``sys.exit(0)``, ``os._exit``) fails
them; a program that searches its own interpreter's memory for the nonce could forge them (an
assert-style test trusts the interpreter it shares with the code; stdin/stdout tests do not).

Scores per sample: ``overall`` (``pass_rate`` or ``all_passed``, by ``score``), ``pass_rate``,
``all_passed``, ``no_code`` (1 when the response holds no code block), and for each way a case can
fail the fraction of the sample's cases that failed so (``wrong_answer``, ``runtime_error``,
``wall_time``, ``cpu_time``, ``memory``, ``file_size``, ``output_limit``), plus ``leftover_processes``
(processes killed after a run ended; always 0 under namespaces). A sample whose tests are malformed,
or whose runs the sandbox itself could not start, is a :class:`SampleFailure` naming why.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from mmrl.rewards.source import RewardSourceError, SampleFailure, SourceResult
from mmrl.sandbox import Program, RunResult, Sandbox, SandboxError, SandboxLimits

if TYPE_CHECKING:
    from mmrl.config import CodeConfig, SandboxConfig

SCORES = ("pass_rate", "all_passed")
FAILURE_KINDS = (
    "wrong_answer",
    "runtime_error",
    "wall_time",
    "cpu_time",
    "memory",
    "file_size",
    "output_limit",
)
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_PYTHON_TAGS = ("", "python", "py", "python3")
_TOLERANCE = 1e-6


class MalformedTestsError(ValueError):
    """A row's test cases are malformed; the message says what was expected."""


@dataclass(frozen=True)
class CodeTests:
    """A row's test cases. ``kind``: stdio | call | assert."""

    kind: str
    inputs: list[Any] = field(default_factory=list)  # stdio: stdin texts; call: argument lists
    outputs: list[Any] = field(default_factory=list)  # stdio: stdout texts; call: return values
    asserts: list[str] = field(default_factory=list)  # assert: one statement per case
    fn_name: str = ""  # call: the function (or Solution method) to call
    setup: str = ""  # assert: code run after the program, before the asserts

    def __len__(self) -> int:
        return len(self.asserts) if self.kind == "assert" else len(self.inputs)

    def first(self, count: int) -> CodeTests:
        """The first ``count`` cases (all when ``count`` is 0)."""
        if count <= 0 or count >= len(self):
            return self
        return replace(
            self, inputs=self.inputs[:count], outputs=self.outputs[:count], asserts=self.asserts[:count]
        )


@dataclass(frozen=True)
class CaseResult:
    """One test case: ``status`` is passed, one of FAILURE_KINDS, no_code or sandbox_error, and why."""

    status: str
    reason: str | None = None

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass(frozen=True)
class GradeResult:
    """A response graded against its tests."""

    cases: list[CaseResult]
    code_found: bool = True
    leftover_processes: int = 0

    @property
    def pass_rate(self) -> float:
        return sum(case.passed for case in self.cases) / len(self.cases) if self.cases else 0.0

    @property
    def reason(self) -> str | None:
        """The first failing case's reason (None when every case passed)."""
        if not self.code_found:
            return "no code block in the response"
        failed = [(index, case) for index, case in enumerate(self.cases) if not case.passed]
        if not failed:
            return None
        index, case = failed[0]
        return f"{len(failed)} of {len(self.cases)} cases failed; case {index}: {case.reason}"

    def scores(self, score: str) -> dict[str, float]:
        passed_all = float(bool(self.cases) and all(case.passed for case in self.cases))
        total = max(len(self.cases), 1)
        result = {
            "overall": self.pass_rate if score == "pass_rate" else passed_all,
            "pass_rate": self.pass_rate,
            "all_passed": passed_all,
            "no_code": float(not self.code_found),
        }
        for kind in FAILURE_KINDS:
            result[kind] = sum(case.status == kind for case in self.cases) / total
        result["leftover_processes"] = float(self.leftover_processes)
        return result


def extract_code(response: str) -> str | None:
    """The last fenced Python (or unlabelled) block of ``response`` outside ``<think>``; None if none."""
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(_THINK.sub("", response))]
    python_blocks = [body for tag, body in blocks if tag in _PYTHON_TAGS]
    return python_blocks[-1] if python_blocks else None


def parse_test_cases(value: Any) -> CodeTests:
    """A row's test cases (any format of the module docstring) as a :class:`CodeTests`."""
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise MalformedTestsError(f"test cases are not valid JSON ({err})") from err
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return _assert_suite({"asserts": value})
    if isinstance(value, list):
        return _suite_from_list(value)
    if not isinstance(value, Mapping):
        raise MalformedTestsError(f"test cases must be a JSON object or list, got {type(value).__name__}")
    if "asserts" in value:
        return _assert_suite(value)
    inputs, outputs = value.get("inputs"), value.get("outputs")
    if (
        not isinstance(inputs, list)
        or not isinstance(outputs, list)
        or len(inputs) != len(outputs)
        or not inputs
    ):
        raise MalformedTestsError(
            'test cases need "inputs" and "outputs": two non-empty lists of the same length '
            f"(found keys {sorted(value)})"
        )
    fn_name = value.get("fn_name") or ""
    if fn_name:
        return CodeTests(
            "call", inputs=[_call_arguments(item) for item in inputs], outputs=outputs, fn_name=fn_name
        )
    return CodeTests(
        "stdio", inputs=[_text(item) for item in inputs], outputs=[_text(item) for item in outputs]
    )


def _suite_from_list(items: list) -> CodeTests:
    if not items or not all(
        isinstance(item, Mapping) and "input" in item and "output" in item for item in items
    ):
        raise MalformedTestsError(
            'a list of test cases holds {"input": ..., "output": ...} objects (or assert lines)'
        )
    kinds = {item.get("testtype", "stdin") for item in items}
    if kinds == {"stdin"}:
        return parse_test_cases(
            {"inputs": [i["input"] for i in items], "outputs": [i["output"] for i in items]}
        )
    names = {item.get("fn_name") for item in items}
    if kinds == {"functional"} and len(names) == 1 and None not in names:
        outputs = [_json_value(item["output"]) for item in items]  # LiveCodeBench writes them as JSON
        inputs = [item["input"] for item in items]
        return parse_test_cases({"fn_name": names.pop(), "inputs": inputs, "outputs": outputs})
    raise MalformedTestsError(
        f'test cases mix or misname their "testtype" ({sorted(map(str, kinds))}); functional ones need "fn_name"'
    )


def _json_value(item: Any) -> Any:
    if not isinstance(item, str):
        return item
    try:
        return json.loads(item)
    except json.JSONDecodeError as err:
        raise MalformedTestsError(f"functional output {item[:80]!r} is not JSON ({err})") from err


def _assert_suite(value: Mapping) -> CodeTests:
    asserts = value["asserts"]
    if not isinstance(asserts, list) or not asserts or not all(isinstance(item, str) for item in asserts):
        raise MalformedTestsError('"asserts" must be a non-empty list of assert statements (strings)')
    return CodeTests("assert", asserts=list(asserts), setup=str(value.get("setup") or ""))


def _call_arguments(item: Any) -> list:
    if isinstance(item, list):
        return item
    if isinstance(item, str):  # LiveCodeBench: one JSON value per line
        try:
            return [json.loads(line) for line in item.splitlines() if line.strip()]
        except json.JSONDecodeError as err:
            raise MalformedTestsError(
                f"call input {item[:80]!r} is not one JSON value per line ({err})"
            ) from err
    return [item]


def _text(item: Any) -> str:
    if isinstance(item, list):  # some datasets keep stdin / stdout as lists of lines
        return "\n".join(map(str, item))
    return str(item)


# ---------------------------------------------------------------------------------------------------
# comparisons (outside the sandbox)


def stdout_matches(actual: str, expected: str) -> bool:
    """Lines equal after trailing whitespace and blank trailing lines are dropped; numbers within 1e-6."""
    actual_lines, expected_lines = _lines(actual), _lines(expected)
    if len(actual_lines) != len(expected_lines):
        return False
    for actual_line, expected_line in zip(actual_lines, expected_lines):
        actual_tokens, expected_tokens = actual_line.split(), expected_line.split()
        if len(actual_tokens) != len(expected_tokens):
            return False
        if not all(_token_matches(a, e) for a, e in zip(actual_tokens, expected_tokens)):
            return False
    return True


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _token_matches(actual: str, expected: str) -> bool:
    if actual == expected:
        return True
    try:
        return math.isclose(float(actual), float(expected), rel_tol=_TOLERANCE, abs_tol=_TOLERANCE)
    except ValueError:
        return False


def value_matches(actual: Any, expected: Any) -> bool:
    """A call's return value against the expected one: tuples as lists, floats within 1e-6, and an
    expected one-element list also accepting its element (APPS wraps outputs so)."""
    if _equal(actual, expected):
        return True
    return isinstance(expected, list) and len(expected) == 1 and _equal(actual, expected[0])


def _equal(actual: Any, expected: Any) -> bool:
    if isinstance(actual, tuple):
        actual = list(actual)
    if isinstance(actual, list) and isinstance(expected, list):
        return len(actual) == len(expected) and all(_equal(a, e) for a, e in zip(actual, expected))
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(_equal(actual[k], expected[k]) for k in actual)
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (actual, expected))
    if numbers and (isinstance(actual, float) or isinstance(expected, float)):
        return math.isclose(actual, expected, rel_tol=_TOLERANCE, abs_tol=_TOLERANCE)
    return actual == expected


# ---------------------------------------------------------------------------------------------------
# the harness of call and assert suites (runs inside the sandbox, with the program)

_HARNESS = r"""
import json, os, sys
_out = os.fdopen(os.dup(1), "w")  # results go here even if the program replaces sys.stdout
_nonce = sys.stdin.readline().strip()
_suite = json.loads(sys.stdin.readline())
_namespace = {"__name__": "solution", "__builtins__": __builtins__}

def _report(index, **result):
    _out.write(_nonce + " " + json.dumps({"i": index, **result}, default=repr) + "\n")
    _out.flush()

def _error(err):
    message = str(err)[:200]
    return type(err).__name__ + (": " + message if message else "")

try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), _namespace)
    if _suite["setup"]:
        exec(compile(_suite["setup"], "setup", "exec"), _namespace)
    _loaded = None
except BaseException as err:
    _loaded = "the program failed to load: " + _error(err)
if _suite["kind"] == "call" and _loaded is None:
    _function = _namespace.get(_suite["fn_name"])
    if _function is None and isinstance(_namespace.get("Solution"), type):
        _function = getattr(_namespace["Solution"](), _suite["fn_name"], None)
    if _function is None:
        _loaded = "the program defines no function or Solution method " + repr(_suite["fn_name"])
for _index, _case in enumerate(_suite["cases"]):
    if _loaded is not None:
        _report(_index, error=_loaded)
        continue
    try:
        if _suite["kind"] == "call":
            _report(_index, value=_function(*_case))
        else:
            exec(compile(_case, "assert " + str(_index), "exec"), _namespace)
            _report(_index, value=True)
    except BaseException as err:
        _report(_index, error=_error(err))
"""


def harness_program(code: str, suite: CodeTests, nonce: str) -> Program:
    """One program running every call or assert case of ``suite`` against ``code``."""
    cases = suite.inputs if suite.kind == "call" else suite.asserts
    description = {"kind": suite.kind, "fn_name": suite.fn_name, "setup": suite.setup, "cases": cases}
    stdin = nonce + "\n" + json.dumps(description) + "\n"
    return Program(files={"solution.py": code, "main.py": _HARNESS}, argv=("main.py",), stdin=stdin)


# ---------------------------------------------------------------------------------------------------
# grading


def case_failure(run: RunResult) -> CaseResult | None:
    """The case's failure when the run did not exit with 0 (None when it did)."""
    if run.ok:
        return None
    reason = run.reason
    if run.outcome == "sandbox_error":
        return CaseResult("sandbox_error", reason)
    if run.outcome == "wall_timeout":
        return CaseResult("wall_time", reason)
    if run.outcome == "output_limit":
        return CaseResult("output_limit", reason)
    if reason.startswith("CPU time"):
        return CaseResult("cpu_time", reason)
    if reason.startswith("file size") or "File too large" in run.stderr:
        return CaseResult("file_size", reason)
    if "MemoryError" in run.stderr:
        return CaseResult("memory", reason)
    return CaseResult("runtime_error", reason)


def grade_stdio(run: RunResult, expected: str) -> CaseResult:
    failure = case_failure(run)
    if failure is not None:
        return failure
    if stdout_matches(run.stdout, expected):
        return CaseResult("passed")
    return CaseResult("wrong_answer", f"expected {_preview(expected)}, got {_preview(run.stdout)}")


def grade_harness(run: RunResult, suite: CodeTests, nonce: str) -> list[CaseResult]:
    """Per-case results of a harness run: its nonce-tagged lines, else the run's failure for the rest."""
    reported: dict[int, dict] = {}
    for line in run.stdout.splitlines():
        if line.startswith(nonce + " "):
            try:
                entry = json.loads(line[len(nonce) + 1 :])
                reported[int(entry["i"])] = entry
            except (ValueError, KeyError, TypeError):
                continue
    missing = case_failure(run) or CaseResult("runtime_error", "the program ended before this case ran")
    results = []
    for index in range(len(suite)):
        entry = reported.get(index)
        if entry is None:
            results.append(missing)
        elif "error" in entry:
            error = str(entry["error"])
            if suite.kind == "assert" and error.startswith("AssertionError"):
                results.append(CaseResult("wrong_answer", f"{_preview(suite.asserts[index])} failed"))
            else:
                results.append(CaseResult("runtime_error", error))
        elif suite.kind == "assert" or value_matches(entry.get("value"), suite.outputs[index]):
            results.append(CaseResult("passed"))
        else:
            expected = json.dumps(suite.outputs[index], default=repr)
            got = json.dumps(entry.get("value"), default=repr)
            results.append(CaseResult("wrong_answer", f"expected {_preview(expected)}, got {_preview(got)}"))
    return results


def _preview(text: str, limit: int = 160) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


class CodeGrader:
    """Grades responses against test suites in ``sandbox``; the runs of a whole batch share its slots.

    ``limits`` bound each stdin/stdout case; a call or assert suite runs as one program whose CPU and
    wall time are those of one case times the number of cases.
    """

    def __init__(self, sandbox: Sandbox, limits: SandboxLimits | None = None, max_test_cases: int = 0):
        self.sandbox = sandbox
        self.limits = limits or sandbox.limits
        self.max_test_cases = max_test_cases

    def grade(self, responses: Sequence[str], suites: Sequence[CodeTests]) -> list[GradeResult]:
        """One :class:`GradeResult` per response, in order."""
        jobs: list[tuple[int, Program, SandboxLimits]] = []  # (sample, program, limits)
        nonces: dict[int, str] = {}
        codes = [extract_code(response) for response in responses]
        suites = [suite.first(self.max_test_cases) for suite in suites]
        for sample, (code, suite) in enumerate(zip(codes, suites)):
            if code is None:
                continue
            if suite.kind == "stdio":
                jobs += [
                    (sample, self.sandbox.python_program(code, stdin), self.limits) for stdin in suite.inputs
                ]
            else:
                nonces[sample] = secrets.token_hex(16)
                scaled = replace(
                    self.limits,
                    cpu_time_s=self.limits.cpu_time_s * len(suite),
                    wall_time_s=self.limits.wall_time_s * len(suite),
                )
                jobs.append((sample, harness_program(code, suite, nonces[sample]), scaled))
        runs = self._run_all(jobs)
        return [
            self._assemble(sample, code, suites[sample], runs, nonces) for sample, code in enumerate(codes)
        ]

    def _run_all(self, jobs: list[tuple[int, Program, SandboxLimits]]) -> dict[int, list[RunResult]]:
        runs: dict[int, list[RunResult]] = {}
        if not jobs:
            return runs
        with ThreadPoolExecutor(max_workers=min(self.sandbox.max_concurrency, len(jobs))) as pool:
            results = list(pool.map(lambda job: self.sandbox.run(job[1], job[2]), jobs))
        for (sample, _, _), result in zip(jobs, results):
            runs.setdefault(sample, []).append(result)
        return runs

    def _assemble(self, sample, code, suite, runs, nonces) -> GradeResult:
        if code is None:
            return GradeResult(cases=[CaseResult("no_code", "no code block")] * len(suite), code_found=False)
        sample_runs = runs.get(sample, [])
        leftovers = sum(run.leftover_processes for run in sample_runs)
        if suite.kind == "stdio":
            cases = [grade_stdio(run, expected) for run, expected in zip(sample_runs, suite.outputs)]
        else:
            cases = grade_harness(sample_runs[0], suite, nonces[sample])
        return GradeResult(cases=cases, leftover_processes=leftovers)


class CodeSource:
    """The ``code`` reward source (see the module docstring); ``grader`` holds the sandbox."""

    name = "code"
    needs_media = False

    def __init__(self, grader: CodeGrader, test_cases_key: str = "ground_truth", score: str = "pass_rate"):
        if score not in SCORES:
            raise RewardSourceError(f"worker.reward.code.score: {score!r} is not one of {list(SCORES)}")
        self.grader = grader
        self.test_cases_key = test_cases_key
        self.score_name = score
        self.last_grades: list[GradeResult | None] = []  # of the last batch, with the reasons

    def score(self, inputs: Sequence[Mapping[str, Any]]) -> list[SourceResult]:
        suites: list[CodeTests | SampleFailure] = [
            self._suite(sample, index) for index, sample in enumerate(inputs)
        ]
        runnable = [index for index, suite in enumerate(suites) if isinstance(suite, CodeTests)]
        grades = self.grader.grade(
            [str(inputs[i]["response"]) for i in runnable], [suites[i] for i in runnable]
        )
        results: list[SourceResult] = list(suites)  # failures stay; graded samples are replaced below
        self.last_grades = [None] * len(inputs)
        for index, grade in zip(runnable, grades):
            self.last_grades[index] = grade
            broken = [case for case in grade.cases if case.status == "sandbox_error"]
            results[index] = SampleFailure(broken[0].reason) if broken else grade.scores(self.score_name)
        return results

    def _suite(self, sample: Mapping[str, Any], index: int) -> CodeTests | SampleFailure:
        if self.test_cases_key not in sample:
            return SampleFailure(
                f"the row has no {self.test_cases_key!r} (worker.reward.code.test_cases_key)"
            )
        try:
            return parse_test_cases(sample[self.test_cases_key])
        except MalformedTestsError as err:
            return SampleFailure(f"the row's {self.test_cases_key!r}: {err}")

    def close(self) -> None:
        pass


def build_sandbox(config: SandboxConfig) -> Sandbox:
    """The sandbox of ``worker.reward.code.sandbox`` (checks once that it can run here)."""
    limits = SandboxLimits(
        cpu_time_s=config.cpu_time_s,
        wall_time_s=config.wall_time_s,
        memory_bytes=config.memory_bytes,
        file_size_bytes=config.file_size_bytes,
        disk_bytes=config.disk_bytes,
        max_processes=config.max_processes,
        max_open_files=config.max_open_files,
        max_output_bytes=config.max_output_bytes,
    )
    try:
        return Sandbox(
            limits,
            isolation=config.isolation,
            max_concurrency=config.max_concurrency,
            python=config.python,
            read_only_paths=config.read_only_paths,
        )
    except SandboxError as err:
        raise SandboxError(f"worker.reward.code.sandbox: {err}") from None


def build_code_source(code: CodeConfig) -> CodeSource:
    """The ``code`` source of ``worker.reward.code`` (built where it runs: in a reward worker)."""
    grader = CodeGrader(build_sandbox(code.sandbox), max_test_cases=code.max_test_cases)
    return CodeSource(grader, test_cases_key=code.test_cases_key, score=code.score)
