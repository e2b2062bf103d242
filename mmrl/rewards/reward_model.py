"""A discriminative reward model: prompt + response → one number, in batches, in the reward workers.

Two heads (``worker.reward.reward_model.head``):

- ``classification``: a Hugging Face sequence-classification model with one label
  (``AutoModelForSequenceClassification``, e.g. a Qwen2 reward model); its logit is the score. Text
  only: the conversation (the question as user turn, the response as assistant turn, through the
  model's chat template) is what it reads.
- ``yes_token``: any causal or vision-language LM (``load_model``); the score is
  ``logit("yes") - logit("no")`` (of the words' first tokens) at the first answer position after the prompt (the judge prompt of
  :mod:`mmrl.rewards.judge`, or ``prompt_template``), with the sample's images shown to a
  vision-language model: a generative judge read as a discriminative reward model, one forward pass
  per response instead of a decode.

Scores are normalised per batch (``normalize``: ``none``, ``sigmoid``, ``batch_zscore``). The model
lives on the reward worker's device (``device``: its GPU when Ray gave it one) and, on a GPU, moves to
CPU memory between batches (``offload``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mmrl.rewards.source import RewardSourceError, SampleFailure, SourceResult

if TYPE_CHECKING:
    from mmrl.config import RewardModelConfig

NORMALIZATIONS = ("none", "sigmoid", "batch_zscore")
HEADS = ("classification", "yes_token")
_MARKER = re.compile(r"<(image|video)>")


def normalize_scores(scores: list[float], mode: str) -> list[float]:
    """``none``: as they are; ``sigmoid``: 1 / (1 + e^-s); ``batch_zscore``: (s - mean) / std over the
    batch (std over all scores, population form; a batch of equal scores gives zeros)."""
    import math

    if mode == "none" or not scores:
        return list(scores)
    if mode == "sigmoid":
        return [1.0 / (1.0 + math.exp(-score)) for score in scores]
    if mode == "batch_zscore":
        mean = sum(scores) / len(scores)
        std = math.sqrt(sum((score - mean) ** 2 for score in scores) / len(scores))
        return [(score - mean) / std if std > 0 else 0.0 for score in scores]
    raise ValueError(f"unknown normalisation {mode!r}; expected one of {list(NORMALIZATIONS)}")


class RewardModelSource:
    """Reward source ``reward_model`` (see the module docstring)."""

    name = "reward_model"

    def __init__(
        self,
        model_path: str,
        head: str = "classification",
        template: str | None = None,
        normalize: str = "none",
        batch_size: int = 16,
        max_length: int = 2048,
        device: str = "auto",
        offload: bool = True,
        prompt_key: str = "problem",
    ):
        import jinja2
        import torch

        from mmrl.rewards.judge import DEFAULT_TEMPLATE

        self.head = head
        self.normalize = normalize
        self.batch_size = batch_size
        self.max_length = max_length
        self.prompt_key = prompt_key
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        )
        self.offload = offload and self.device.type != "cpu"
        self.template = None
        if template is not None or head == "yes_token":
            self.template = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(
                template or DEFAULT_TEMPLATE
            )
        self.model, self.tokenizer, self.processor = _load(model_path, head)
        self.needs_media = self.processor is not None
        if head == "yes_token":
            self.yes_no_ids = _answer_tokens(self.tokenizer, model_path)
        self.model.to("cpu" if self.offload else self.device)

    def score(self, inputs: Sequence[Mapping[str, Any]]) -> list[SourceResult]:
        import torch

        if self.offload:
            self.model.to(self.device)
        raw: list[float | SampleFailure] = []
        try:
            with torch.no_grad():
                for start in range(0, len(inputs), self.batch_size):
                    raw.extend(self._score_batch(inputs[start : start + self.batch_size], start))
        finally:
            if self.offload:
                self.model.to("cpu")
                torch.cuda.empty_cache()
        values = normalize_scores([r for r in raw if not isinstance(r, SampleFailure)], self.normalize)
        scores = iter(values)
        return [r if isinstance(r, SampleFailure) else {"overall": next(scores)} for r in raw]

    def _score_batch(self, batch: Sequence[Mapping[str, Any]], start: int) -> list[float]:
        texts = [self._text(sample, start + i) for i, sample in enumerate(batch)]
        if self.head == "classification":
            encoded = self.tokenizer(
                texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length
            ).to(self.device)
            return self.model(**encoded).logits[:, 0].float().tolist()
        encoded = self._encode_with_media(texts, batch).to(self.device)
        logits = self.model(**encoded).logits[:, -1].float()  # [B, V]: left padding puts every end last
        yes, no = self.yes_no_ids
        return (logits[:, yes] - logits[:, no]).tolist()

    def _text(self, sample: Mapping[str, Any], index: int) -> str:
        """The whole text the model reads, chat template applied."""
        question = str(sample.get(self.prompt_key, ""))
        if self.template is None:  # classification, default: the conversation itself
            messages = [
                {"role": "user", "content": _MARKER.sub("", question).strip()},
                {"role": "assistant", "content": str(sample["response"])},
            ]
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        import jinja2

        try:
            text = self.template.render(**{"question": question, **sample})
        except jinja2.TemplateError as err:
            raise RewardSourceError(
                f"reward model prompt failed on sample {index}: {type(err).__name__}: {err}"
            ) from None
        content: Any = _MARKER.sub("", text).strip()
        if self.processor is not None:
            images = len(getattr(sample.get("media"), "images", ()))
            content = [{"type": "image"}] * images + [{"type": "text", "text": content}]
        messages = [{"role": "user", "content": content}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _encode_with_media(self, texts: list[str], batch: Sequence[Mapping[str, Any]]) -> Any:
        if self.processor is None:
            return self.tokenizer(
                texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length
            )
        from mmrl.data.media import load_image

        images = [load_image(ref, None, None) for s in batch for ref in getattr(s.get("media"), "images", ())]
        return self.processor(
            text=texts,
            images=images or None,
            return_tensors="pt",
            padding=True,
            return_mm_token_type_ids=True,
        )

    def close(self) -> None:
        self.model = None


def _load(model_path: str, head: str) -> tuple[Any, Any, Any]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from mmrl.data.processing import load_tokenizer_and_processor

    if head == "classification":
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForSequenceClassification.from_pretrained(model_path)
        if model.config.num_labels != 1:
            raise RewardSourceError(
                f"worker.reward.reward_model.model_path={model_path} has {model.config.num_labels} labels; a "
                "reward model has one (its logit is the score)"
            )
        model.config.pad_token_id = tokenizer.pad_token_id  # the last non-pad token is the one scored
        processor = None
    else:
        from mmrl.models.loading import load_model

        tokenizer, processor = load_tokenizer_and_processor(model_path)
        model = load_model(model_path)
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"  # a long input keeps its end: the response
    if processor is not None:
        processor.tokenizer.padding_side = "left"
    return model.eval(), tokenizer, processor


def _answer_tokens(tokenizer: Any, model_path: str) -> list[int]:
    """The first tokens of "yes" and "no" (the whole words in most tokenizers), which must differ."""
    first = [tokenizer.encode(word, add_special_tokens=False)[:1] for word in ("yes", "no")]
    if not all(first) or first[0] == first[1]:
        raise RewardSourceError(
            f"worker.reward.reward_model.head=yes_token: 'yes' and 'no' start with the same token in "
            f"{model_path}'s tokenizer ({first}); the head compares the logits of their first tokens"
        )
    return [first[0][0], first[1][0]]


def build_reward_model(config: RewardModelConfig, prompt_key: str) -> RewardModelSource:
    template = None
    if config.prompt_template:
        with open(config.prompt_template, encoding="utf-8") as handle:
            template = handle.read()
    return RewardModelSource(
        config.model_path,
        head=config.head,
        template=template,
        normalize=config.normalize,
        batch_size=config.batch_size,
        max_length=config.max_length,
        device=config.device,
        offload=config.offload,
        prompt_key=prompt_key,
    )
