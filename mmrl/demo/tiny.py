"""Tiny random Qwen models with a locally trained tokenizer and processor, for tests and the CPU demo.

Kinds (``build_tiny_model(kind, out_dir, size, seed)``), each a folder that the usual Hugging Face
calls reload:

- ``qwen2_5_vl``: ``Qwen2_5_VLForConditionalGeneration``; ``AutoModelForImageTextToText`` and
  ``AutoProcessor`` (``Qwen2_5_VLProcessor``).
- ``qwen2_5_omni``: the Qwen2.5-Omni thinker (text + vision + audio tower), saved the way the real
  ``Qwen/Qwen2.5-Omni-*`` checkpoints are: a ``Qwen2_5OmniConfig`` (``enable_audio_output=False``,
  no talker weights) with ``thinker.*`` weights, so vLLM serves it. Reload the trainable part with
  ``Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained`` (no Auto class maps the
  ``qwen2_5_omni`` model type to the thinker) and ``AutoProcessor`` (``Qwen2_5OmniProcessor``).
- ``qwen2``: ``Qwen2ForCausalLM``; ``AutoModelForCausalLM`` and ``AutoTokenizer``.
- ``qwen3_vl``: ``Qwen3VLForConditionalGeneration`` (interleaved M-RoPE, deepstack features of the
  first vision blocks added in the first decoder layers); ``AutoModelForImageTextToText`` and
  ``AutoProcessor`` (``Qwen3VLProcessor``: 16-pixel patches, timestamps between video frames).
- ``qwen3_vl_moe``: ``Qwen3VLMoeForConditionalGeneration``, Qwen3-VL with every decoder MLP a sparse
  block of ``MOE_EXPERTS`` experts (top-2, softmax router); the same processor.
- ``glm4v``: ``Glm4vForConditionalGeneration`` (GLM-4.1V: 3-D RoPE on half of each head, a vision tower
  with learned 2-D positions interpolated per image); ``AutoProcessor`` (``Glm4vProcessor``: a video
  is a run of frames, each ``<|begin_of_image|>`` + image tokens + ``<|end_of_image|>`` + its second).
  GLM's media tokens in the Qwen-style chat template the other kinds use (not GLM's ``<|user|>`` one).
- ``qwen3_5``: ``Qwen3_5ForConditionalGeneration`` (Qwen3.5: a linear-attention layer, gated delta net,
  then a full-attention layer; Qwen3-VL's vision tower without deepstack); Qwen3-VL's processor.
- ``qwen3_5_moe``: ``Qwen3_5MoeForConditionalGeneration``, Qwen3.5 with every decoder MLP a sparse block
  of ``MOE_EXPERTS`` routed experts (top-2, softmax router) beside a sigmoid-gated shared expert.
- ``qwen3_omni_moe``: the Qwen3-Omni thinker (Qwen3-VL MoE's decoder and vision tower, an audio tower of
  three stride-2 convolutions), saved as the full ``Qwen3OmniMoeForConditionalGeneration`` without
  talker (``thinker.*`` weights, one tensor per expert as the released checkpoints); ``AutoProcessor``
  (``Qwen3OmniMoeProcessor``: Qwen3-VL's image processor, Whisper features padded to the longest clip).

Sizes (parameters for VL / Omni thinker / text): ``tiny``, text hidden 64 with 2 layers (0.39M / 0.48M /
0.15M), and ``small``, hidden 256 with 4 layers (13.0M / 15.0M / 7.2M). Every attention head is 32
(tiny) or 64 (small) wide: vLLM's CPU backend needs ``head_dim >= 32``. Weights are float32.
``small-151k`` (Qwen2.5-VL only, 52M): ``small`` with Qwen's real 151,936-row vocabulary, for what
scales with tokens x vocabulary at small widths (``bench/scale_phases.py``).
``3b-width`` (Qwen2.5-VL only, 0.55B): Qwen2.5-VL-3B's widths, rotary settings and real vocabulary
(151,936 rows, tied) with 2 decoder layers and 2 vision blocks, for measuring what scales with the
vocabulary and the widths (memory of log-prob passes, weight sync) without the 3B's depth.

The tokenizer is a byte-level BPE trained on ``TINY_CORPUS`` with Qwen's pre-tokenizer, Qwen's special
tokens (the Omni names for Omni), ``<think>``/``</think>``/``<answer>``/``</answer>`` as whole tokens
and a Qwen-style chat template. Every answer word of ``mmrl.demo.synthetic`` is one token. At
``3b-width`` its merges are extended by synthetic ones (concatenations of trained tokens) to Qwen2.5's
151,665 entries, then ``<|reserved_N|>`` tokens fill it to the model's 151,936 rows, so that every id a
random model samples decodes.

A folder is complete when ``BUILD_MARKER`` exists (written last); building again with the same
arguments returns at once.

CLI: ``python -m mmrl.demo.tiny --kind qwen2_5_vl --size tiny [--out DIR] [--seed 0] [--force]``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mmrl.demo.synthetic import COLORS, SHAPES, TASKS

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerFast, ProcessorMixin

KINDS = (
    "qwen2_5_vl",
    "qwen2_5_omni",
    "qwen2",
    "qwen3_vl",
    "qwen3_vl_moe",
    "glm4v",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_omni_moe",
)
BUILD_MARKER = "mmrl_tiny.json"
# Bumped whenever the architecture, tokenizer or processor settings change, so stale folders rebuild.
BUILD_VERSION = 2  # 2: the corpus holds the video and audio tasks' questions and answers

# Image / video resize bounds in pixels: 56x56 (4 patches of 28 after merging) up to 64 such patches.
MIN_PIXELS = 28 * 28 * 4
MAX_PIXELS = 28 * 28 * 64
AUDIO_SAMPLING_RATE = 16000
AUDIO_CHUNK_LENGTH_S = 10  # the Omni processor pads every clip to this length; longer clips are cut
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Qwen's pre-tokenizer split (also what transformers' Qwen2Tokenizer rebuilds on load): letters with
# one leading non-letter, single digits, punctuation runs, newlines, spaces.
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
MOE_EXPERTS = 4  # experts per sparse block of the tiny MoE kinds (top-2 routed)
REASONING_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")

# Named multimodal tokens per kind, in Qwen's id order. Qwen2.5-Omni renames the Qwen2.5 tokens
# (<|vision_start|> -> <|vision_bos|>, <|image_pad|> -> <|IMAGE|>, ...) and its processor reads them
# from these tokenizer attributes.
_VL_TOKENS = {
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
}
_OMNI_TOKENS = {
    "audio_token": "<|AUDIO|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
}
# Qwen3-Omni: Qwen3-VL's vision names, the audio ones after them; the processor reads the Omni attributes
_OMNI3_TOKENS = {
    "audio_token": "<|audio_pad|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
}
# GLM-4.1V: a video's frames are image tokens between <|begin_of_video|> and <|end_of_video|>
_GLM4V_TOKENS = {
    "image_start_token": "<|begin_of_image|>",
    "image_end_token": "<|end_of_image|>",
    "video_start_token": "<|begin_of_video|>",
    "video_end_token": "<|end_of_video|>",
    "image_token": "<|image|>",
    "video_token": "<|video|>",
}
NAMED_TOKENS: dict[str, dict[str, str]] = {
    "qwen2_5_vl": _VL_TOKENS,
    "qwen2_5_omni": _OMNI_TOKENS,
    "qwen2": _VL_TOKENS,
    "qwen3_vl": _VL_TOKENS,
    "qwen3_vl_moe": _VL_TOKENS,
    "glm4v": _GLM4V_TOKENS,
    "qwen3_5": _VL_TOKENS,
    "qwen3_5_moe": _VL_TOKENS,
    "qwen3_omni_moe": _OMNI3_TOKENS,
}
CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"


@dataclass(frozen=True)
class ModelSize:
    """Widths and depths of one size; ``head_dim = hidden_size / num_heads`` for every tower."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vision_hidden_size: int
    vision_depth: int
    vision_heads: int
    vision_intermediate_size: int
    audio_hidden_size: int
    audio_layers: int
    audio_heads: int
    audio_ffn_size: int
    num_mel_bins: int
    vocab_size: int  # BPE target including special tokens; TINY_CORPUS yields ~460 tokens
    # None: the tokenizer is what TINY_CORPUS yields; else synthetic merges extend it to this many
    # entries and reserved tokens fill it to vocab_size (the model's rows)
    tokenizer_size: int | None = None
    max_position_embeddings: int = 4096
    kinds: tuple[str, ...] = KINDS  # the kinds built at this size
    min_pixels: int = MIN_PIXELS  # the processor's image / video frame resize bounds
    max_pixels: int = MAX_PIXELS
    tie_word_embeddings: bool = True  # Qwen2.5-VL / Qwen2 / Qwen3-VL (Omni is always untied)
    # Qwen3-VL MoE's sparse blocks at this size: experts, experts per token, each expert's MLP width
    # (None: a quarter of intermediate_size)
    num_experts: int = MOE_EXPERTS
    experts_per_token: int = 2
    moe_intermediate_size: int | None = None
    explicit_head_dim: int | None = None  # Qwen3's text layers may be wider than hidden_size / num_heads

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    @property
    def mrope_section(self) -> list[int]:
        """Rotary pairs for (temporal, height, width), in Qwen's 1/4, 3/8, 3/8 split of head_dim / 2."""
        pairs = self.head_dim // 2
        temporal = pairs // 4
        height = (pairs - temporal) // 2
        return [temporal, height, pairs - temporal - height]


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(
        hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256,
        vision_hidden_size=64, vision_depth=2, vision_heads=2, vision_intermediate_size=128,
        audio_hidden_size=64, audio_layers=1, audio_heads=2, audio_ffn_size=128, num_mel_bins=32,
        vocab_size=1024,
    ),
    "small": ModelSize(
        hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=2048,
        vision_hidden_size=256, vision_depth=4, vision_heads=4, vision_intermediate_size=1024,
        audio_hidden_size=256, audio_layers=2, audio_heads=4, audio_ffn_size=1024, num_mel_bins=80,
        vocab_size=1024,
    ),
    # the small model with Qwen's real vocabulary: what scales with tokens x vocabulary, at small widths
    "small-151k": ModelSize(
        hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=2048,
        vision_hidden_size=256, vision_depth=4, vision_heads=4, vision_intermediate_size=1024,
        audio_hidden_size=64, audio_layers=1, audio_heads=2, audio_ffn_size=128, num_mel_bins=80,
        vocab_size=151_936, tokenizer_size=151_665, kinds=("qwen2_5_vl",),
    ),
    # Qwen2.5-VL-3B-Instruct's config.json widths; depth cut to 2 decoder layers and 2 vision blocks.
    "3b-width": ModelSize(
        hidden_size=2048, num_layers=2, num_heads=16, num_kv_heads=2, intermediate_size=11008,
        vision_hidden_size=1280, vision_depth=2, vision_heads=16, vision_intermediate_size=3420,
        audio_hidden_size=64, audio_layers=1, audio_heads=2, audio_ffn_size=128, num_mel_bins=128,
        vocab_size=151_936, tokenizer_size=151_665, max_position_embeddings=128_000,
        kinds=("qwen2_5_vl",), min_pixels=56 * 56, max_pixels=28 * 28 * 16384,  # the 3B processor's
    ),
    # Qwen3-VL-30B-A3B-Instruct's config.json widths (128 experts of 768, top-8; 32 heads of 128 over a
    # 2,048-wide stream); depth cut to 1 decoder layer and 1 vision block; the head tied to the embedding
    # (the released model's is a matrix of its own: 311M parameters more)
    "30b-a3b-width": ModelSize(
        hidden_size=2048, num_layers=1, num_heads=32, num_kv_heads=4, intermediate_size=6144,
        vision_hidden_size=1152, vision_depth=1, vision_heads=16, vision_intermediate_size=4304,
        audio_hidden_size=64, audio_layers=1, audio_heads=2, audio_ffn_size=128, num_mel_bins=128,
        vocab_size=151_936, tokenizer_size=151_665, max_position_embeddings=262_144,
        kinds=("qwen3_vl_moe",), num_experts=128, experts_per_token=8, moe_intermediate_size=768,
        explicit_head_dim=128,
    ),
}  # fmt: skip


# The tasks whose questions and answers the tokenizer learns from (those of BUILD_VERSION 2): a task added
# later is tokenized with these merges, so that it changes no tiny tokenizer, nor any token count, golden
# value or demo number measured with one.
CORPUS_TASKS = ("color", "count", "spatial", "video_flashes", "video_direction", "audio_beeps")


def _answer_words() -> list[str]:
    return sorted({answer for name in CORPUS_TASKS for answer in TASKS[name].answers})


def _build_corpus() -> list[str]:
    """Short English lines: the synthetic tasks' questions and answers, prompt templates, reasoning."""
    questions = [re.sub(r"<(image|video|audio)>", "", TASKS[name].question) for name in CORPUS_TASKS]
    answers = _answer_words()
    lines = [
        DEFAULT_SYSTEM_PROMPT,
        "You FIRST think about the reasoning process as an internal monologue and then provide the "
        "final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final "
        "answer MUST BE put in \\boxed{}.",
        "Output the thinking process in <think> </think> and final answer in <answer> </answer> tags.",
        "Please reason step by step, and put your final answer within \\boxed{}.",
        "<think>I look at the image and count the circles one by one.</think><answer>3</answer>",
        "<think>The shape in the picture is filled with one colour.</think><answer>red</answer>",
        "The answer is \\boxed{4}. Let me think: two plus two is four, so the answer is 4.",
        "What is in this picture? A small image with a circle, a square or a triangle on a white "
        "background. How many shapes are there, and what colour are they?",
        "the a an of to in is it that this there are was were be with on for as at by from and or not",
        "one two three four five six seven eight nine ten zero number numbers count answer question",
        "user assistant system image video audio picture sound beep beeps dot moves left right up down",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 100 3.14 1/2 x + y = z - 5 * 2",
    ]
    lines += [f"{question} {answer}" for question in questions for answer in answers]
    lines += [f"The {color} {shape} is {color}." for color in COLORS for shape in SHAPES]
    lines += [f"There are {n} circles. {n}" for n in range(1, 10)]
    # Role names as the chat template writes them, so that "user" is one token (Omni's user_token_id).
    lines += ["system\nuser\nassistant\n"] * 4
    # Answers on their own and after a space, many times, so BPE merges each into one token.
    lines += [f"{answer}\n {answer}\n{answer.capitalize()}" for answer in answers] * 8
    return lines


TINY_CORPUS: list[str] = _build_corpus()


def chat_template(named_tokens: dict[str, str], system_prompt: str = DEFAULT_SYSTEM_PROMPT) -> str:
    """Qwen-style Jinja chat template: ``<|im_start|>role\\n...<|im_end|>\\n`` per message, a default
    system message, media content items rendered as their placeholder between begin/end tokens."""
    vision_bos = named_tokens.get("vision_bos_token", named_tokens.get("vision_start_token"))
    vision_eos = named_tokens.get("vision_eos_token", named_tokens.get("vision_end_token"))
    media = {  # GLM-4.1V brackets images and videos with tokens of their own
        kind: named_tokens.get(f"{kind}_start_token", vision_bos)
        + named_tokens[f"{kind}_token"]
        + named_tokens.get(f"{kind}_end_token", vision_eos)
        for kind in ("image", "video")
    }
    if "audio_token" in named_tokens:
        audio_tokens = (
            named_tokens["audio_bos_token"],
            named_tokens["audio_token"],
            named_tokens["audio_eos_token"],
        )
        media["audio"] = "".join(audio_tokens)
    media_branches = "".join(
        f"{{% elif content['type'] == '{kind}' or '{kind}' in content or '{kind}_url' in content %}}{text}"
        for kind, text in media.items()
    )
    # with tools= (multi-turn rollouts): Qwen's way, the schemas in the system message and each tool
    # answer in a user turn between <tool_response> tags
    tools_block = (
        "{% if tools %}{{ '\\n\\n# Tools\\n<tools>' }}{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
        "{{ '\\n</tools>\\n' }}"
        'Call a tool as <tool_call>{"name": <name>, "arguments": {...}}</tool_call>{% endif %}'
    )
    return (
        "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}"
        f"<|im_start|>system\n{system_prompt}{tools_block}<|im_end|>\n"
        "{% endif %}"
        "{% if message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
        "{% else %}<|im_start|>{{ message['role'] }}\n{% endif %}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for content in message['content'] %}"
        "{% if content['type'] == 'text' or ('text' in content and 'type' not in content) %}"
        "{{ content['text'] }}"
        f"{media_branches}"
        "{% endif %}{% endfor %}{% endif %}"
        "{% if message['role'] == 'tool' %}{{ '\\n' }}</tool_response>{% endif %}"
        "<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def _train_bpe(corpus: list[str], num_merged_tokens: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE vocabulary and merges, trained with Qwen's normaliser and pre-tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=num_merged_tokens,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    model_json = json.loads(backend.to_str())["model"]
    merges = [
        tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge) for merge in model_json["merges"]
    ]
    return model_json["vocab"], merges


def _extend_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], size: int) -> None:
    """Add merges ``(a, b) -> a + b`` of trained tokens, in id order, until ``vocab`` has ``size``
    entries (in place). Later merges rank below the trained ones, and every new token is a sequence of
    bytes, so encoding stays byte-level BPE (text round-trips) and every new id decodes."""
    trained = sorted(vocab, key=vocab.__getitem__)
    for first in trained:
        for second in trained:
            if len(vocab) >= size:
                return
            token = first + second
            if token not in vocab:
                vocab[token] = len(vocab)
                merges.append((first, second))
    raise ValueError(f"cannot extend a {len(trained)}-token BPE to {size} entries by pairs")


def train_tokenizer(
    corpus: list[str],
    vocab_size: int,
    kind: str = "qwen2_5_vl",
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    tokenizer_size: int | None = None,
) -> PreTrainedTokenizerFast:
    """A Qwen2 tokenizer (``PreTrainedTokenizerFast``) over a BPE trained on ``corpus``.

    Ids: the trained byte-level vocabulary first (at most ``vocab_size`` minus the added tokens), then
    ``<think>`` .. ``</answer>`` (normal added tokens), then the special tokens: ``<|endoftext|>``
    (pad), ``<|im_start|>``, ``<|im_end|>`` (eos) and the kind's named multimodal tokens, which are also
    tokenizer attributes (``tokenizer.image_token`` ...) as the Qwen processors expect.
    With ``tokenizer_size`` the byte-level vocabulary is extended by synthetic merges
    (:func:`_extend_bpe`) so that the tokenizer has that many entries, followed by ``<|reserved_N|>``
    tokens (normal added tokens) up to ``vocab_size``.
    """
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    named_tokens = NAMED_TOKENS[kind]
    special_tokens = [*CHAT_TOKENS, *named_tokens.values()]
    added = len(REASONING_TOKENS) + len(special_tokens)
    vocab, merges = _train_bpe(corpus, vocab_size - added)
    if tokenizer_size is not None:
        _extend_bpe(vocab, merges, tokenizer_size - added)
    for token in [*REASONING_TOKENS, *special_tokens]:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=list(special_tokens),
        model_specific_special_tokens=dict(named_tokens),
        chat_template=chat_template(named_tokens, system_prompt),
        model_max_length=4096 if tokenizer_size is None else 131_072,  # Qwen2.5-VL's at real size
    )
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in REASONING_TOKENS])
    if tokenizer_size is not None:
        reserved = [f"<|reserved_{index}|>" for index in range(vocab_size - len(tokenizer))]
        tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in reserved])
    return tokenizer


def check_single_token_answers(tokenizer: PreTrainedTokenizerFast, words: list[str]) -> None:
    """Raises unless every word is one token, alone and (for words) after a space.

    Digits never merge with a leading space in Qwen's pre-tokenizer (" 3" is " " + "3"), so only their
    bare form is checked.
    """
    for word in words:
        variants = [word] if word.isdigit() else [word, " " + word]
        for variant in variants:
            ids = tokenizer.encode(variant, add_special_tokens=False)
            if len(ids) != 1:
                pieces = tokenizer.convert_ids_to_tokens(ids)
                raise AssertionError(
                    f"answer word {variant!r} is {len(ids)} tokens {pieces}, expected 1; add it to TINY_CORPUS "
                    f"more often or raise the vocabulary size"
                )


def _token_ids(tokenizer: PreTrainedTokenizerFast, kind: str) -> dict[str, int]:
    names = {"pad": PAD_TOKEN, "eos": EOS_TOKEN, **NAMED_TOKENS[kind]}
    return {name: tokenizer.convert_tokens_to_ids(token) for name, token in names.items()}


def _text_config(size: ModelSize, vocab_size: int, ids: dict[str, int], mrope: bool) -> dict[str, Any]:
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": 1_000_000.0}
    if mrope:
        rope_parameters["mrope_section"] = size.mrope_section
    return {
        "vocab_size": vocab_size,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_layers,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "max_position_embeddings": size.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_parameters": rope_parameters,
        "bos_token_id": ids["pad"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
    }


def _vision_config(size: ModelSize) -> dict[str, Any]:
    return {
        "depth": size.vision_depth,
        "hidden_size": size.vision_hidden_size,
        "num_heads": size.vision_heads,
        "intermediate_size": size.vision_intermediate_size,
        "out_hidden_size": size.hidden_size,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        # The last block attends over the whole image, the others within windows, as in Qwen2.5-VL.
        "fullatt_block_indexes": [size.vision_depth - 1],
    }


def _talker_config(size: ModelSize, ids: dict[str, int]) -> dict[str, Any]:
    """A small talker config. No talker is built (``enable_audio_output=False``); its config still
    describes one, and its token ids must lie inside the vocabularies to pass config validation."""
    return {
        "vocab_size": 8448,
        "embedding_size": size.hidden_size,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "head_dim": size.head_dim,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": size.mrope_section,
        },
        "audio_token_index": ids["audio_token"],
        "image_token_index": ids["image_token"],
        "video_token_index": ids["video_token"],
        "vision_start_token_id": ids["vision_bos_token"],
        "vision_end_token_id": ids["vision_eos_token"],
        "audio_start_token_id": ids["audio_bos_token"],
        "audio_end_token_id": ids["audio_eos_token"],
        # Text-side ids of the real talker (151859..151861) do not exist in the tiny vocabulary.
        "tts_text_start_token_id": ids["pad"],
        "tts_text_end_token_id": ids["pad"],
        "tts_text_pad_token_id": ids["pad"],
    }


def build_config(kind: str, size: ModelSize, tokenizer: PreTrainedTokenizerFast) -> PreTrainedConfig:
    """The Hugging Face config of ``kind`` at ``size``, with the tokenizer's vocabulary and ids."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5OmniConfig, Qwen2Config

    ids = _token_ids(tokenizer, kind)
    vocab_size = len(tokenizer)
    if kind == "qwen2":
        return Qwen2Config(**_text_config(size, vocab_size, ids, mrope=False), tie_word_embeddings=True)
    if kind in ("qwen3_vl", "qwen3_vl_moe"):
        return _qwen3_vl_config(size, vocab_size, ids, moe=kind == "qwen3_vl_moe")
    if kind == "glm4v":
        return _glm4v_config(size, vocab_size, ids)
    if kind in ("qwen3_5", "qwen3_5_moe"):
        return _qwen3_5_config(size, vocab_size, ids, moe=kind == "qwen3_5_moe")
    if kind == "qwen3_omni_moe":
        return _qwen3_omni_config(size, vocab_size, ids, tokenizer.convert_tokens_to_ids("user"))
    if kind == "qwen2_5_vl":
        tied = {"tie_word_embeddings": size.tie_word_embeddings}
        text_config = {**_text_config(size, vocab_size, ids, mrope=True), **tied}
        return Qwen2_5_VLConfig(
            text_config=text_config,
            vision_config={**_vision_config(size), "tokens_per_second": 2},
            image_token_id=ids["image_token"],
            video_token_id=ids["video_token"],
            vision_start_token_id=ids["vision_start_token"],
            vision_end_token_id=ids["vision_end_token"],
            **tied,
        )
    if kind == "qwen2_5_omni":
        # Untied like Qwen2.5-Omni-7B: vLLM's thinker reads tying from the text config, transformers
        # from the thinker config; keeping both False avoids a disagreement about lm_head.
        text_config = {**_text_config(size, vocab_size, ids, mrope=True), "tie_word_embeddings": False}
        audio_config = {
            "num_mel_bins": size.num_mel_bins,
            "encoder_layers": size.audio_layers,
            "encoder_attention_heads": size.audio_heads,
            "encoder_ffn_dim": size.audio_ffn_size,
            "d_model": size.audio_hidden_size,
            "output_dim": size.hidden_size,
        }
        thinker_config = {
            "text_config": text_config,
            "vision_config": _vision_config(size),
            "audio_config": audio_config,
            "audio_token_index": ids["audio_token"],
            "image_token_index": ids["image_token"],
            "video_token_index": ids["video_token"],
            "audio_start_token_id": ids["audio_bos_token"],
            "audio_end_token_id": ids["audio_eos_token"],
            "vision_start_token_id": ids["vision_bos_token"],
            "vision_end_token_id": ids["vision_eos_token"],
            "user_token_id": tokenizer.convert_tokens_to_ids("user"),
            "tie_word_embeddings": False,
        }
        return Qwen2_5OmniConfig(
            thinker_config=thinker_config, talker_config=_talker_config(size, ids), enable_audio_output=False
        )
    raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {KINDS}")


def _qwen3_vl_config(
    size: ModelSize, vocab_size: int, ids: dict[str, int], moe: bool = False
) -> PreTrainedConfig:
    """A Qwen3-VL config: Qwen3 text layers (explicit ``head_dim``, q/k norms) with interleaved M-RoPE
    (Qwen3-VL's 24:20:20 split of the rotary pairs), and a vision tower of 16-pixel patches whose first
    blocks feed deepstack mergers (block i's features are added in decoder layer i). ``moe``: the
    Qwen3-VL MoE config, every decoder MLP a sparse block of the size's experts (``MOE_EXPERTS``, top-2, at
    the small sizes)."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    pairs = size.head_dim // 2
    spatial = round(pairs * 20 / 64)
    text_config = {
        **_text_config(size, vocab_size, ids, mrope=False),
        "head_dim": size.head_dim,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [pairs - 2 * spatial, spatial, spatial],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": True,
    }
    if moe:  # experts a quarter of the dense MLP wide, as Qwen3-VL-30B-A3B's (768 vs 6144 per expert)
        expert_width = size.moe_intermediate_size or size.intermediate_size // 4
        text_config |= {"num_experts": size.num_experts, "num_experts_per_tok": size.experts_per_token,
                        "moe_intermediate_size": expert_width, "decoder_sparse_step": 1}  # fmt: skip
    vision_config = {
        "depth": size.vision_depth,
        "hidden_size": size.vision_hidden_size,
        "num_heads": size.vision_heads,
        "intermediate_size": size.vision_intermediate_size,
        "out_hidden_size": size.hidden_size,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 256,  # a 16 x 16 grid of learned positions, interpolated per image
        # block i feeds decoder layer i; never the last layer, whose visual positions no later token reads
        "deepstack_visual_indexes": list(range(min(size.vision_depth, size.num_layers - 1))),
    }
    return (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["image_token"],
        video_token_id=ids["video_token"],
        vision_start_token_id=ids["vision_start_token"],
        vision_end_token_id=ids["vision_end_token"],
        tie_word_embeddings=True,
    )


def _qwen3_omni_config(
    size: ModelSize, vocab_size: int, ids: dict[str, int], user_id: int
) -> PreTrainedConfig:
    """A Qwen3-Omni config (``enable_audio_output=False``: the thinker only, as mmrl trains it): Qwen3-VL
    MoE's text and vision configs (every decoder MLP ``MOE_EXPERTS`` experts, top-2; deepstack) and a
    Qwen3-Omni audio tower (three stride-2 convolutions: 13 tokens per 100 mel frames), untied like
    Qwen3-Omni-30B-A3B; 13 position ids per second of video, as its processor counts."""
    from transformers import Qwen3OmniMoeConfig

    vision_ids = {"vision_start_token": ids["vision_bos_token"], "vision_end_token": ids["vision_eos_token"]}
    qwen3_vl = _qwen3_vl_config(size, vocab_size, ids | vision_ids, moe=True)
    text_keys = (*_text_config(size, vocab_size, ids, mrope=False), "head_dim", "rope_parameters",
                 "num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step")  # fmt: skip
    text_config = {key: getattr(qwen3_vl.text_config, key) for key in text_keys} | {"norm_topk_prob": True}
    vision_keys = ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "patch_size",
                   "spatial_merge_size", "temporal_patch_size", "num_position_embeddings",
                   "deepstack_visual_indexes")  # fmt: skip
    audio_config = {
        "num_mel_bins": size.num_mel_bins,
        "encoder_layers": size.audio_layers,
        "encoder_attention_heads": size.audio_heads,
        "encoder_ffn_dim": size.audio_ffn_size,
        "d_model": size.audio_hidden_size,
        "downsample_hidden_size": size.audio_hidden_size // 2,
        "output_dim": size.hidden_size,
    }
    thinker_config = {
        "text_config": text_config,
        "vision_config": {key: getattr(qwen3_vl.vision_config, key) for key in vision_keys},
        "audio_config": audio_config,
        "audio_token_id": ids["audio_token"],
        "image_token_id": ids["image_token"],
        "video_token_id": ids["video_token"],
        "audio_start_token_id": ids["audio_bos_token"],
        "audio_end_token_id": ids["audio_eos_token"],
        "vision_start_token_id": ids["vision_bos_token"],
        "vision_end_token_id": ids["vision_eos_token"],
        "user_token_id": user_id,
        "position_id_per_seconds": 13,
        "tie_word_embeddings": False,
    }
    return Qwen3OmniMoeConfig(thinker_config=thinker_config, enable_audio_output=False)


def _qwen3_vl_processor(tokenizer: PreTrainedTokenizerFast, audio: Any = None) -> ProcessorMixin:
    """``Qwen3VLProcessor``: images and video frames resized into ``[MIN_PIXELS, MAX_PIXELS]`` in
    32-pixel steps (16-pixel patches, 2x2 merge), normalised with mean = std = 0.5 as Qwen3-VL's; each
    video becomes frames of 2 temporal patches, each after its ``<t seconds>`` timestamp. With an
    ``audio`` feature extractor: ``Qwen3OmniMoeProcessor`` with the same image processor, Qwen2-VL's
    video processor (Qwen3-Omni numbers frames by position ids, not timestamps) and that extractor."""
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
        Qwen3OmniMoeProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    vision = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2}
    normalise = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    frames = {"min_frames": 2, "max_frames": 32, "fps": 2.0, "cap_pixels_per_frame": True}
    image_processor = Qwen2VLImageProcessor(size=size, **vision, **normalise)
    template = tokenizer.chat_template
    if audio is not None:
        video_processor = Qwen2VLVideoProcessor(size=size, **vision, **normalise, **frames)
        return Qwen3OmniMoeProcessor(
            image_processor=image_processor,
            video_processor=video_processor,
            feature_extractor=audio,
            tokenizer=tokenizer,
            chat_template=template,
        )
    video_processor = Qwen3VLVideoProcessor(size=size, **vision, **normalise, **frames)
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=template,
    )


def _whisper_features(num_mel_bins: int) -> Any:
    """Whisper's 16 kHz log-mel features with ``num_mel_bins`` bins over ``AUDIO_CHUNK_LENGTH_S``
    windows (Qwen2.5-Omni's processor pads every clip to it; Qwen3-Omni's pads to the longest clip)."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(
        feature_size=num_mel_bins,
        sampling_rate=AUDIO_SAMPLING_RATE,
        chunk_length=AUDIO_CHUNK_LENGTH_S,
        return_attention_mask=True,
    )


def _glm4v_config(size: ModelSize, vocab_size: int, ids: dict[str, int]) -> PreTrainedConfig:
    """A GLM-4.1V config: GLM-4 text layers (q/k/v biases, fused gate-up MLP, norms after attention and
    MLP) whose 3-D RoPE turns half of each head (GLM-4.1V-9B's ``partial_rotary_factor`` 0.5, its 8:12:12
    split of the rotary pairs), untied like GLM-4.1V-9B; a vision tower of 14-pixel patches, 2x2 merged
    by a strided convolution, with learned positions on an 8x8 grid (GLM-4.1V: 24x24)."""
    from transformers import Glm4vConfig

    pairs = size.head_dim // 4  # rotary pairs of half a head
    temporal = pairs // 4
    height = (pairs - temporal) // 2
    text_config = {
        **_text_config(size, vocab_size, ids, mrope=False),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [temporal, height, pairs - temporal - height],
        },
        "rms_norm_eps": 1e-5,
        # as the released GLM-4.1V configs say (transformers' GLM-4 attention has q/k/v biases whatever
        # the config says; vLLM reads this key, which the glm4v family also sets for configs without it)
        "attention_bias": True,
    }
    vision_config = {
        "depth": size.vision_depth,
        "hidden_size": size.vision_hidden_size,
        "num_heads": size.vision_heads,
        "intermediate_size": size.vision_intermediate_size,
        "out_hidden_size": size.hidden_size,
        "patch_size": 14,
        "image_size": 112,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return Glm4vConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["image_token"],
        video_token_id=ids["video_token"],
        image_start_token_id=ids["image_start_token"],
        image_end_token_id=ids["image_end_token"],
        video_start_token_id=ids["video_start_token"],
        video_end_token_id=ids["video_end_token"],
        tie_word_embeddings=False,
    )


def _qwen3_5_config(
    size: ModelSize, vocab_size: int, ids: dict[str, int], moe: bool = False
) -> PreTrainedConfig:
    """A Qwen3.5 config: Qwen3-VL's (interleaved M-RoPE on a quarter of each head, as Qwen3.5's
    ``partial_rotary_factor`` 0.25) with the first decoder layer a gated delta net (linear attention,
    128-wide heads: vLLM's CPU kernel takes no other) and the last a gated full-attention layer, and a
    vision tower without deepstack mergers. ``moe``: the Qwen3.5 MoE config, every decoder MLP
    ``MOE_EXPERTS`` routed experts (top-2) and a shared expert, each a quarter of the dense MLP wide
    (Qwen3.5-35B-A3B: 256 routed and one shared expert of 512)."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    qwen3_vl = _qwen3_vl_config(size, vocab_size, ids).to_dict()
    pairs = size.head_dim // 8  # rotary pairs of a quarter of a head, in about equal thirds
    spatial = pairs // 3
    text_config = {
        **_text_config(size, vocab_size, ids, mrope=False),
        "head_dim": size.head_dim,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [pairs - 2 * spatial, spatial, spatial],
            "mrope_interleaved": True,
        },
        "layer_types": ["linear_attention"] * (size.num_layers - 1) + ["full_attention"],
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
    }
    if moe:
        expert_width = text_config.pop("intermediate_size") // 4
        text_config |= {"num_experts": MOE_EXPERTS, "num_experts_per_tok": 2,
                        "moe_intermediate_size": expert_width, "shared_expert_intermediate_size": expert_width}  # fmt: skip
    vision_keys = ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "patch_size",
                   "spatial_merge_size", "temporal_patch_size", "num_position_embeddings")  # fmt: skip
    return (Qwen3_5MoeConfig if moe else Qwen3_5Config)(
        text_config=text_config,
        vision_config={key: qwen3_vl["vision_config"][key] for key in vision_keys},
        image_token_id=ids["image_token"],
        video_token_id=ids["video_token"],
        vision_start_token_id=ids["vision_start_token"],
        vision_end_token_id=ids["vision_end_token"],
        tie_word_embeddings=True,
    )


def _glm4v_processor(tokenizer: PreTrainedTokenizerFast, pixels: tuple[int, int]) -> ProcessorMixin:
    """``Glm4vProcessor``: images and video frames resized into ``pixels`` in 28-pixel steps (14-pixel
    patches, 2x2 merge), CLIP's normalisation as GLM-4.1V's; frames sampled at 2 fps, two per temporal
    patch, each temporal patch after its second. GLM's image resize bounds the pixels of the 2 frames
    an image's temporal patch repeats it to, so the image range is twice ``pixels``."""
    from transformers import Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor

    size = {"shortest_edge": pixels[0], "longest_edge": pixels[1]}
    image_size = {"shortest_edge": 2 * pixels[0], "longest_edge": 2 * pixels[1]}
    vision = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
    return Glm4vProcessor(
        image_processor=Glm4vImageProcessor(size=image_size, **vision),
        video_processor=Glm4vVideoProcessor(size=size, max_image_size={"longest_edge": pixels[1]}, **vision),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )


def model_class(kind: str) -> type[PreTrainedModel]:
    """The transformers class that builds the saved model of ``kind``; for Omni that is the full model
    with the talker switched off, whose only submodule is the thinker."""
    import transformers

    names = {
        "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
        "qwen2_5_omni": "Qwen2_5OmniForConditionalGeneration",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3_vl": "Qwen3VLForConditionalGeneration",
        "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
        "glm4v": "Glm4vForConditionalGeneration",
        "qwen3_5": "Qwen3_5ForConditionalGeneration",
        "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
        "qwen3_omni_moe": "Qwen3OmniMoeForConditionalGeneration",
    }
    if kind not in names:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {KINDS}")
    return getattr(transformers, names[kind])


def build_processor(
    kind: str,
    tokenizer: PreTrainedTokenizerFast,
    num_mel_bins: int = 128,
    pixels: tuple[int, int] = (MIN_PIXELS, MAX_PIXELS),
) -> ProcessorMixin | None:
    """The multimodal processor of ``kind`` around ``tokenizer`` (None for the text-only ``qwen2``).

    Images and videos are resized into ``pixels`` (min, max; default ``[MIN_PIXELS, MAX_PIXELS]``); a
    56x56 image gives a 4x4 patch grid, i.e. 4 placeholder tokens after the 2x2 merge. Omni audio: 16 kHz log-mel features with
    ``num_mel_bins`` bins (the audio tower's), padded to ``AUDIO_CHUNK_LENGTH_S``.
    """
    if kind == "qwen2":
        return None
    if kind in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"):
        return _qwen3_vl_processor(tokenizer)
    if kind == "glm4v":
        return _glm4v_processor(tokenizer, pixels)
    if kind == "qwen3_omni_moe":
        return _qwen3_vl_processor(tokenizer, _whisper_features(num_mel_bins))
    from transformers import (
        Qwen2_5_VLProcessor,
        Qwen2_5OmniProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    size = {"shortest_edge": pixels[0], "longest_edge": pixels[1]}
    vision = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
    image_processor = Qwen2VLImageProcessor(size=size, **vision)
    video_processor = Qwen2VLVideoProcessor(
        size=size, **vision, min_frames=2, max_frames=32, fps=2.0, cap_pixels_per_frame=True
    )
    template = tokenizer.chat_template
    if kind == "qwen2_5_vl":
        return Qwen2_5_VLProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=video_processor,
            chat_template=template,
        )
    return Qwen2_5OmniProcessor(
        image_processor=image_processor,
        video_processor=video_processor,
        feature_extractor=_whisper_features(num_mel_bins),
        tokenizer=tokenizer,
        chat_template=template,
    )


def _size(size: str) -> ModelSize:
    if size not in SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; expected one of {sorted(SIZES)}")
    return SIZES[size]


def _checked_tokenizer(kind: str, spec: ModelSize) -> PreTrainedTokenizerFast:
    """The tokenizer of ``kind`` trained on ``TINY_CORPUS`` (~10 ms, deterministic; ~2 s extended to
    a real vocabulary), answers checked."""
    tokenizer = train_tokenizer(TINY_CORPUS, spec.vocab_size, kind, tokenizer_size=spec.tokenizer_size)
    check_single_token_answers(tokenizer, _answer_words())
    return tokenizer


def count_parameters(kind: str, size: str = "tiny") -> int:
    """Parameters of ``kind`` at ``size`` (shared tensors once), counted on the meta device."""
    spec = _size(size)
    config = build_config(kind, spec, _checked_tokenizer(kind, spec))
    with torch.device("meta"):
        model = model_class(kind)(config)
    return sum(parameter.numel() for parameter in model.parameters())


def _read_marker(out_dir: Path) -> dict[str, Any] | None:
    marker = out_dir / BUILD_MARKER
    return json.loads(marker.read_text()) if marker.is_file() else None


def is_complete(out_dir: str | Path, kind: str, size: str = "tiny", seed: int = 0) -> bool:
    """True when ``out_dir`` holds a finished build of exactly this kind, size, seed and version."""
    marker = _read_marker(Path(out_dir))
    request = {"kind": kind, "size": size, "seed": seed, "version": BUILD_VERSION}
    return marker is not None and all(marker.get(key) == value for key, value in request.items())


def _set_generation_config(model: PreTrainedModel, ids: dict[str, int]) -> None:
    from transformers import GenerationConfig

    # Like Qwen's instruct checkpoints: stop at <|im_end|> or <|endoftext|>, greedy unless asked.
    model.generation_config = GenerationConfig(
        eos_token_id=[ids["eos"], ids["pad"]], pad_token_id=ids["pad"], bos_token_id=ids["pad"]
    )


def build_tiny_model(
    kind: str, out_dir: str | Path, size: str = "tiny", seed: int = 0, force: bool = False
) -> Path:
    """Builds (or finds complete) a random ``kind`` model of ``size`` with tokenizer and processor.

    Writes safetensors weights, config, generation config, tokenizer and processor files into a
    temporary sibling folder, then ``BUILD_MARKER``, then renames it to ``out_dir``. Same ``seed`` ->
    identical weights. A folder without the marker is never overwritten unless ``force``.
    """
    out_dir = Path(out_dir)
    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {KINDS}")
    spec = _size(size)
    if is_complete(out_dir, kind, size, seed) and not force:
        return out_dir
    if out_dir.exists() and _read_marker(out_dir) is None and any(out_dir.iterdir()) and not force:
        raise FileExistsError(
            f"{out_dir} exists, is not empty and was not written by mmrl.demo.tiny (no {BUILD_MARKER}); "
            "pass force=True (--force) to replace it or choose another folder"
        )

    if kind not in spec.kinds:
        raise ValueError(f"size {size!r} is built for {spec.kinds} only, not {kind!r}")
    tokenizer = _checked_tokenizer(kind, spec)
    config = build_config(kind, spec, tokenizer)
    with torch.random.fork_rng(devices=[]):  # seeds the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = model_class(kind)(config).eval()
    _set_generation_config(model, _token_ids(tokenizer, kind))

    tmp_dir = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    model.save_pretrained(tmp_dir)
    processor = build_processor(kind, tokenizer, spec.num_mel_bins, (spec.min_pixels, spec.max_pixels))
    (processor or tokenizer).save_pretrained(tmp_dir)
    if kind == "qwen2_5_omni":
        # Qwen2_5OmniForConditionalGeneration.from_pretrained requires the speaker table of the talker.
        torch.save({}, tmp_dir / "spk_dict.pt")
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    marker = {"kind": kind, "size": size, "seed": seed, "version": BUILD_VERSION,
              "num_parameters": num_parameters, "vocab_size": len(tokenizer)}  # fmt: skip
    (tmp_dir / BUILD_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    _move_into_place(tmp_dir, out_dir, lambda: is_complete(out_dir, kind, size, seed))
    return out_dir


def _move_into_place(tmp_dir: Path, out_dir: Path, done_elsewhere: Callable[[], bool]) -> None:
    """Renames the finished ``tmp_dir`` to ``out_dir``; if another process finished the same build
    first (several ranks or test workers asking at once), keeps theirs."""
    if done_elsewhere():
        shutil.rmtree(tmp_dir)
        return
    shutil.rmtree(out_dir, ignore_errors=True)
    try:
        tmp_dir.rename(out_dir)
    except OSError:
        if not done_elsewhere():
            raise
        shutil.rmtree(tmp_dir)


_FOLDER_NAMES = {
    "qwen2_5_vl": "qwen2.5-vl",
    "qwen2_5_omni": "qwen2.5-omni",
    "qwen2": "qwen2",
    "qwen3_vl": "qwen3-vl",
    "qwen3_vl_moe": "qwen3-vl-moe",
    "glm4v": "glm-4.1v",
    "qwen3_5": "qwen3.5",
    "qwen3_5_moe": "qwen3.5-moe",
    "qwen3_omni_moe": "qwen3-omni-moe",
}


def tiny_model_path(kind: str, size: str = "tiny", root: str | Path = "assets/models") -> Path:
    """Conventional folder of a built model, e.g. ``assets/models/tiny-qwen2.5-vl``."""
    if kind not in _FOLDER_NAMES:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {KINDS}")
    return Path(root) / f"{size}-{_FOLDER_NAMES[kind]}"


def ensure_tiny_model(
    kind: str, size: str = "tiny", root: str | Path = "assets/models", seed: int = 0
) -> Path:
    """``tiny_model_path(kind, size, root)``, built first if it is not complete."""
    return build_tiny_model(kind, tiny_model_path(kind, size, root), size, seed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Build a tiny random Qwen model with tokenizer and processor."
    )
    parser.add_argument("--kind", choices=KINDS, default="qwen2_5_vl")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--out", default=None, help="output folder (default: assets/models/<size>-<kind>)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    args = parser.parse_args(argv)
    out_dir = Path(args.out) if args.out else tiny_model_path(args.kind, args.size)
    up_to_date = not args.force and is_complete(out_dir, args.kind, args.size, args.seed)
    build_tiny_model(args.kind, out_dir, args.size, args.seed, args.force)
    marker = _read_marker(out_dir)
    print(
        f"[mmrl.demo.tiny] {'up to date' if up_to_date else 'built'}: {args.kind} ({args.size}), "
        f"{marker['num_parameters']:,} parameters, vocabulary {marker['vocab_size']} -> {out_dir}"
    )


if __name__ == "__main__":
    main()
