"""The generative judge against a real HTTP server on loopback that the test starts: answers, retries on
429/5xx with backoff, slow answers, a server that dies mid-run, the cache, the key kept secret, media in
the request, the parsers."""

from __future__ import annotations

import base64
import io
import threading
import time

import pytest
from _judge_server import ScriptedJudge, answer, status
from PIL import Image

from mmrl.config import JudgeConfig
from mmrl.data.processing import PromptMedia
from mmrl.rewards.judge import DEFAULT_TEMPLATE, JudgeSource, build_judge, message_content
from mmrl.rewards.openai_client import ChatClient, ResponseCache
from mmrl.rewards.parsers import PARSERS, parse_number, parse_rubric, parse_yes_no
from mmrl.rewards.source import RewardSourceError, SampleFailure

BODY = {"model": "judge", "messages": [{"role": "user", "content": "Is 2 + 2 = 4?"}], "max_tokens": 4}


def _client(judge: ScriptedJudge, **kwargs) -> ChatClient:
    options = {"max_retries": 2, "backoff_s": 0.01, "timeout_s": 5.0, **kwargs}
    return ChatClient(judge.base_url, **options)


def _body(index: int) -> dict:
    return {**BODY, "messages": [{"role": "user", "content": f"question {index}"}]}


# ---------------------------------------------------------------- parsers


@pytest.mark.parametrize(
    ("text", "expected"),
    [("Yes.", 1.0), ("**No**, the shape is red", 0.0), ("<|im_start|>yes<|im_end|>", 1.0), ("maybe", None)],
)
def test_yes_no_parser(text, expected):
    assert parse_yes_no(text) == PARSERS["yes_no"](text, 10.0) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("Score: 7", 0.7), ("8/10.", 0.8), ("first 3, final 9", 0.9), ("-2", 0.0), ("12", 1.0), ("none", None)],
)
def test_number_parser_reads_the_last_number_over_number_max(text, expected):
    assert parse_number(text, 10.0) == PARSERS["number"](text, 10.0) == expected


def test_rubric_parser_sums_points_over_maxima():
    assert parse_rubric("accuracy: 2/2, reasoning: 1/3") == PARSERS["rubric"]("1/2, 2/3", 10.0) == 0.6
    assert parse_rubric("no points here") is None


# ---------------------------------------------------------------- the client


def test_429_and_5xx_are_retried_with_backoff_then_answered():
    with ScriptedJudge([status(429), status(503), answer("yes")]) as judge:
        client = _client(judge)
        assert client.complete(BODY) == "yes"
    assert len(judge.requests) == 3 and client.stats.retries == 2


def test_retry_after_header_sets_the_wait():
    with ScriptedJudge([status(429, {"Retry-After": "0.4"}), answer("no")]) as judge:
        start = time.perf_counter()
        assert _client(judge).complete(BODY) == "no"
    assert time.perf_counter() - start >= 0.4


def test_a_request_still_failing_after_its_retries_fails_alone_with_the_reason():
    with ScriptedJudge([status(503)] * 3) as judge:
        result = _client(judge, max_concurrency=1).complete_many([_body(0), _body(1)])
    assert (
        result[0] == SampleFailure('HTTP 503: {"error": {"message": "scripted 503"}} (after 3 tries)')
        and result[1] == "yes"
    )


def test_a_bad_request_is_not_retried():
    with ScriptedJudge([status(400)]) as judge:
        result = _client(judge).complete(BODY)
    assert isinstance(result, SampleFailure) and result.reason.startswith("HTTP 400")
    assert len(judge.requests) == 1


def test_a_slow_answer_times_out_and_is_asked_again():
    # the retry's answer comes within 1 s even on a loaded machine; the sleeping answers never do
    with ScriptedJudge(["sleep:3.0"]) as judge:
        client = _client(judge, timeout_s=1.0, max_retries=1)
        assert client.complete(BODY) == "yes"
        judge.script = ["sleep:3.0", "sleep:3.0"]
        failed = client.complete(BODY)
    assert failed == SampleFailure("no answer within timeout_s=1 (after 2 tries)")


def test_a_server_dying_mid_run_fails_the_rest_by_name_and_returns():
    judge = ScriptedJudge()

    def answer_then_die(body):
        threading.Thread(target=judge.die).start()
        return 200, "yes", {}

    judge.script = [answer("no"), answer("no"), answer_then_die]
    client = _client(judge, max_concurrency=1, max_retries=1)
    start = time.perf_counter()
    results = client.complete_many([_body(i) for i in range(6)])
    assert results[:3] == ["no", "no", "yes"]
    assert all(isinstance(r, SampleFailure) and r.reason.startswith("connection failed") for r in results[3:])
    assert "(after 2 tries)" in results[3].reason
    assert time.perf_counter() - start < 5  # refused connections fail fast: no hang


def test_concurrency_is_bounded():
    with ScriptedJudge(default=None) as judge:
        judge.script = ["sleep:0.2"] * 8
        _client(judge, max_concurrency=3).complete_many([_body(i) for i in range(8)])
    assert judge.max_in_flight == 3


def test_the_cache_answers_repeated_and_resumed_requests_without_asking(tmp_path):
    path = tmp_path / "judge_cache.sqlite"
    with ScriptedJudge() as judge:
        client = _client(judge, cache=ResponseCache(path))
        client.complete_many([_body(0), _body(1)])
        client.complete_many([_body(0), _body(1)])  # re-scoring the same responses
        assert len(judge.requests) == 2 and client.stats.cache_hits == 2
        resumed = _client(judge, cache=ResponseCache(path))  # a new process of a resumed run
        assert resumed.complete(_body(1)) == "yes" and len(judge.requests) == 2
        assert resumed.complete({**_body(1), "temperature": 1.0}) == "yes"  # another request: asked
        assert len(judge.requests) == 3


def test_the_api_key_is_sent_and_never_shown(monkeypatch, capsys):
    secret = "sk-test-5ecret-never-printed"
    monkeypatch.setenv("MMRL_TEST_JUDGE_KEY", secret)
    config = JudgeConfig(enable=True, api_key_env="MMRL_TEST_JUDGE_KEY", max_retries=1, backoff_s=0.01)
    with ScriptedJudge([status(503), status(503), status(401)]) as judge:
        source = build_judge(config, judge.base_url, "judge", None, "problem")
        failed = source.score([{"response": "red", "ground_truth": "red", "problem": "colour?"}])
        with pytest.raises(RewardSourceError) as err:
            source.score([{"response": "red", "ground_truth": "red", "problem": "colour?"}])
    assert judge.headers[0]["Authorization"] == f"Bearer {secret}"
    assert "$MMRL_TEST_JUDGE_KEY was refused" in str(err.value)
    shown = str(err.value) + str(failed) + repr(source.client.__dict__) + "".join(capsys.readouterr())
    assert secret not in shown


def test_a_missing_key_variable_is_named():
    config = JudgeConfig(enable=True, api_key_env="MMRL_TEST_UNSET_VARIABLE")
    with pytest.raises(RewardSourceError, match=r"\$MMRL_TEST_UNSET_VARIABLE, which is not set"):
        build_judge(config, "http://127.0.0.1:9/v1", "judge", None, "problem")


# ---------------------------------------------------------------- the judge source


def _png(colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (28, 28), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def test_images_go_where_the_markers_are_and_unmarked_ones_first():
    media = PromptMedia(
        prompt="", images=({"bytes": _png((255, 0, 0)), "path": "red.png"}, _png((0, 0, 255)))
    )
    parts = message_content("Look: <image> What colour?", media, video_frames=4)
    assert [p["type"] for p in parts] == ["image_url", "text", "image_url", "text"]
    decoded = Image.open(io.BytesIO(base64.b64decode(parts[2]["image_url"]["url"].split(",", 1)[1])))
    assert decoded.getpixel((0, 0)) == (255, 0, 0)  # the first image at the marker, the second first


def test_judge_scores_parses_and_counts_unparseable_answers():
    def judged(body):
        text = body["messages"][0]["content"][-1]["text"]
        return 200, ("Yes" if "answered: red" in text else "maybe" if "blue" in text else "No"), {}

    media = PromptMedia(prompt="", images=(_png((220, 30, 30)),))
    samples = [
        {"response": response, "ground_truth": "red", "problem": "<image>What colour?", "media": media}
        for response in ("red", "green", "blue")
    ]
    samples.append({**samples[0], "media": PromptMedia(prompt="", images=(b"not an image",))})
    with ScriptedJudge(default=judged) as judge:
        client = _client(judge)
        source = JudgeSource(client, "judge", DEFAULT_TEMPLATE, unparseable_score=0.25)
        results = source.score(samples)
    assert results[:3] == [
        {"overall": 1.0, "unparseable": 0.0},
        {"overall": 0.0, "unparseable": 0.0},
        {"overall": 0.25, "unparseable": 1.0},
    ]
    assert isinstance(results[3], SampleFailure) and results[3].reason.startswith("media: ")
    content = judge.requests[0]["messages"][0]["content"]
    assert content[0]["type"] == "image_url" and "The reference answer is: red" in content[1]["text"]
    assert len(judge.requests) == 3  # the sample whose image does not decode is never sent


def test_a_template_error_names_the_sample_and_the_variables():
    with ScriptedJudge() as judge:
        source = JudgeSource(_client(judge), "judge", "{{ rubric }}", template_name="judge.jinja")
        with pytest.raises(RewardSourceError, match=r"judge.jinja failed on sample 0: UndefinedError"):
            source.score([{"response": "x", "ground_truth": "y"}])
