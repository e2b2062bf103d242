"""A generative judge that sees the sample's media: prompt → OpenAI-compatible chat request → score.

For each response the judge's prompt is rendered from a Jinja template with ``question`` (the row's
prompt column), ``response``, ``ground_truth`` and the row's other columns. ``<image>`` and ``<video>``
markers in the rendered text (the question usually holds them) place the sample's images and video
frames (``video_frames`` evenly spaced frames per video) as image parts of one user message; media
without a marker go before the text. Images are sent as PNG data URLs, so any OpenAI-compatible
vision endpoint reads them. The answer is turned into a score by a parser (:mod:`mmrl.rewards.parsers`);
an answer it cannot read scores ``unparseable_score`` and is counted (``judge/unparseable``).

Two ways to reach a judge, one client (:class:`~mmrl.rewards.openai_client.ChatClient`): an endpoint
someone else serves (``base_url``), or a model mmrl serves on the run's Ray cluster
(:mod:`mmrl.rewards.judge_server`), whose URL the trainer hands to the reward workers.
"""

from __future__ import annotations

import base64
import io
import os
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mmrl.rewards.parsers import PARSERS
from mmrl.rewards.source import RewardSourceError, SampleFailure, SourceResult

if TYPE_CHECKING:
    from mmrl.config import JudgeConfig
    from mmrl.rewards.openai_client import ChatClient

DEFAULT_TEMPLATE = """{{ question }}

A student answered: {{ response }}
{% if ground_truth %}The reference answer is: {{ ground_truth }}
{% endif %}Is the student's answer correct? Answer yes or no."""
_MARKER = re.compile(r"<(image|video)>")


class JudgeSource:
    """Reward source ``judge``: one chat request per response (see the module docstring)."""

    name = "judge"
    needs_media = True

    def __init__(
        self,
        client: ChatClient,
        model: str,
        template: str = DEFAULT_TEMPLATE,
        template_name: str = "the built-in judge prompt",
        parser: str = "yes_no",
        number_max: float = 10.0,
        unparseable_score: float = 0.0,
        max_tokens: int = 64,
        temperature: float = 0.0,
        video_frames: int = 4,
        prompt_key: str = "problem",
    ):
        import jinja2

        self.client = client
        self.model = model
        self.template_name = template_name
        try:
            self.template = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(template)
        except jinja2.TemplateSyntaxError as err:
            raise RewardSourceError(
                f"judge prompt {template_name}: line {err.lineno}: {err.message}"
            ) from None
        self.parse = PARSERS[parser]
        self.number_max = number_max
        self.unparseable_score = unparseable_score
        self.sampling = {"max_tokens": max_tokens, "temperature": temperature}
        self.video_frames = video_frames
        self.prompt_key = prompt_key

    def score(self, inputs: Sequence[Mapping[str, Any]]) -> list[SourceResult]:
        bodies: list[dict[str, Any] | SampleFailure] = [
            self.request(index, sample) for index, sample in enumerate(inputs)
        ]
        asked = [body for body in bodies if not isinstance(body, SampleFailure)]
        answers = iter(self.client.complete_many(asked))
        results: list[SourceResult] = []
        for body in bodies:
            answer = body if isinstance(body, SampleFailure) else next(answers)
            results.append(answer if isinstance(answer, SampleFailure) else self._score_answer(answer))
        return results

    def request(self, index: int, sample: Mapping[str, Any]) -> dict[str, Any] | SampleFailure:
        """The chat request body for one reward input; a failure when its media cannot be read."""
        import jinja2

        variables = {"question": sample.get(self.prompt_key, ""), **sample}
        try:
            text = self.template.render(**variables)
        except jinja2.TemplateError as err:
            raise RewardSourceError(
                f"judge prompt {self.template_name} failed on sample {index}: {type(err).__name__}: {err} "
                f"(it gets question, response, ground_truth and the columns {sorted(sample)})"
            ) from None
        try:
            content = message_content(text, sample.get("media"), self.video_frames)
        except Exception as err:  # noqa: BLE001 - a sample whose media do not decode fails alone
            return SampleFailure(f"media: {type(err).__name__}: {err}")
        return {"model": self.model, "messages": [{"role": "user", "content": content}], **self.sampling}

    def _score_answer(self, answer: str) -> dict[str, float]:
        score = self.parse(answer, self.number_max)
        if score is None:
            return {"overall": self.unparseable_score, "unparseable": 1.0}
        return {"overall": score, "unparseable": 0.0}

    def close(self) -> None:
        self.client.close()
        if self.client.cache is not None:
            self.client.cache.close()


def message_content(text: str, media: Any, video_frames: int) -> list[dict[str, Any]]:
    """OpenAI chat content parts: ``text`` split at its ``<image>``/``<video>`` markers, each marker
    replaced by the next image (or the next video's frames) of ``media`` (a PromptMedia or None)."""
    images = [image_url(image) for image in getattr(media, "images", ())]
    videos = [
        [image_url(frame) for frame in video_frames_of(v, video_frames)] for v in getattr(media, "videos", ())
    ]
    parts: list[dict[str, Any]] = []
    pieces = _MARKER.split(text)  # text, kind, text, kind, ..., text
    for position, piece in enumerate(pieces):
        if position % 2 == 0:
            if piece.strip():
                parts.append({"type": "text", "text": piece})
            continue
        queue = images if piece == "image" else videos
        if queue:  # a marker without a medium left stays out of the message
            item = queue.pop(0)
            parts.extend(item if isinstance(item, list) else [item])
    leftover = images + [frame for frames in videos for frame in frames]
    return leftover + parts


def image_url(image: Any) -> dict[str, Any]:
    """One image (a compact media ref, bytes, a path or a PIL image) as a PNG data-URL content part."""
    from PIL import Image

    from mmrl.data.media import load_image

    if not isinstance(image, Image.Image):
        image = load_image(image, None, None)
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    encoded = base64.b64encode(buffer.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{encoded}"}}


def video_frames_of(video: Any, num_frames: int) -> list[Any]:
    """``num_frames`` evenly spaced frames of one compact video ref, as PIL images."""
    from PIL import Image

    from mmrl.data.media import load_video

    decoded = load_video(video, min_pixels=1, max_pixels=1 << 30, num_frames=num_frames, frame_multiple=1)
    return [Image.fromarray(frame) for frame in decoded.frames]


def build_judge(
    config: JudgeConfig, base_url: str, model: str, cache_path: str | None, prompt_key: str
) -> JudgeSource:
    """The judge of ``config`` at ``base_url`` (an endpoint, or the URL of the judge mmrl serves)."""
    from mmrl.rewards.openai_client import ChatClient, ResponseCache

    api_key = None
    if config.api_key_env:
        api_key = os.environ.get(config.api_key_env)
        if not api_key:
            raise RewardSourceError(
                f"worker.reward.judge.api_key_env names ${config.api_key_env}, which is not set in the reward "
                "worker's environment (set it where Ray starts its workers, e.g. before `ray start`)"
            )
    template, template_name = DEFAULT_TEMPLATE, "the built-in judge prompt"
    if config.prompt_template:
        template_name = config.prompt_template
        with open(config.prompt_template, encoding="utf-8") as handle:
            template = handle.read()
    client = ChatClient(
        base_url,
        api_key=api_key,
        max_concurrency=config.max_concurrency,
        timeout_s=config.timeout_s,
        max_retries=config.max_retries,
        backoff_s=config.backoff_s,
        cache=ResponseCache(cache_path) if config.cache and cache_path else None,
        api_key_env=config.api_key_env,
    )
    return JudgeSource(
        client,
        model,
        template,
        template_name,
        parser=config.parser,
        number_max=config.number_max,
        unparseable_score=config.unparseable_score,
        max_tokens=config.max_tokens,
        temperature=config.temperature,
        video_frames=config.video_frames,
        prompt_key=prompt_key,
    )
