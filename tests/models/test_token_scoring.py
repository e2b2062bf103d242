"""Chunked log-probs and entropies in the model's head equal those of the whole logits, in values and
gradients, and never materialise a [tokens, vocab] tensor.

Three levels: the autograd function alone against ``log_softmax`` (hidden, weight and bias gradients,
temperature 0.7, chunks of 1 token up to more than all of them, entropy differentiable or logged only);
the tiny Qwen2.5-VL (tied embeddings, ``logits_to_keep``) and the tiny Qwen2.5-Omni thinker (untied,
every position through the head) scored padded, packed and with shared prompts, against the plain
head's logits; and the shapes of every tensor a scored forward and backward create.
"""

from __future__ import annotations

import pytest
import torch
from _batches import TEMPERATURE, build_batch
from _compiling import CountingBackend
from _models import training_model
from torch.utils._python_dispatch import TorchDispatchMode

from mmrl.core_algos import entropy_from_logits, log_probs_from_logits, spread_from_logits
from mmrl.models.inputs import ResponseScoring, response_token_outputs
from mmrl.models.token_scoring import (
    TokenScoring,
    TokenScoringHead,
    chunked_token_scores,
    install_token_scoring_head,
    scoring_tokens,
    token_scoring_head,
)
from mmrl.workers.forward import forward_arguments

ROWS = ({}, {"image": (56, 56)}, {}, {"image": (84, 56)})
RESPONSE_LENGTHS = (6, 3, 7, 1)
CHUNK = 4  # fewer than the 17 response tokens: several chunks, the last one partial


def _reference_scores(hidden, weight, bias, targets, temperature, top_k=0):
    logits = torch.nn.functional.linear(hidden, weight, bias) / temperature
    return log_probs_from_logits(logits, targets), entropy_from_logits(logits, top_k)


def _grads(tensors, loss):
    return torch.autograd.grad(loss, tensors, allow_unused=True)  # Omni's audio tower: no audio here


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("top_k", [0, 4, 11], ids=["vocab", "top4", "top11_is_vocab"])
def test_chunked_scores_equal_log_softmax_in_values_and_gradients(chunk, with_bias, entropy_grad, top_k):
    # top_k: the entropy of the top-k renormalised distribution (core_algos.entropy_from_logits); 11 is
    # the whole vocabulary, so it must equal top_k 0
    generator = torch.Generator().manual_seed(0)
    # [B, L, D]: 10 rows; logits of a few units, as a trained model's (entropies well above 0)
    hidden = (0.3 * torch.randn(2, 5, 8, generator=generator)).requires_grad_()
    weight = torch.randn(11, 8, generator=generator, requires_grad=True)  # [V, D]
    bias = torch.randn(11, generator=generator, requires_grad=True) if with_bias else None
    targets = torch.randint(0, 11, (2, 5), generator=generator)
    coefficients = torch.randn(2, 2, 5, generator=generator)  # a loss weighting every output
    inputs = [hidden, weight] + ([bias] if with_bias else [])

    scoring = TokenScoring(targets, TEMPERATURE, chunk, entropy_grad, entropy_top_k=top_k)
    log_probs, entropies, _, full_entropies = chunked_token_scores(hidden, weight, bias, scoring)
    # the fourth output, logged only: the whole vocabulary's entropy whatever the entropy measure
    whole_vocabulary = _reference_scores(hidden, weight, bias, targets, TEMPERATURE)[1]
    torch.testing.assert_close(full_entropies, whole_vocabulary, atol=1e-5, rtol=1e-5)
    assert not full_entropies.requires_grad
    expected_log_probs, expected_entropies = _reference_scores(
        hidden, weight, bias, targets, TEMPERATURE, top_k
    )
    if top_k in (0, 11):
        torch.testing.assert_close(
            entropies, _reference_scores(hidden, weight, bias, targets, TEMPERATURE)[1]
        )
    else:  # fewer candidates, renormalised: at most log(k), and not the whole-vocabulary value
        assert (entropies <= torch.log(torch.tensor(4.0)) + 1e-6).all()
        assert not torch.allclose(entropies, _reference_scores(hidden, weight, bias, targets, TEMPERATURE)[1])
    torch.testing.assert_close(log_probs, expected_log_probs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropies, expected_entropies, atol=1e-5, rtol=1e-5)
    assert entropies.requires_grad == entropy_grad

    def loss(log_probs, entropies):
        entropy_term = (coefficients[1] * entropies).sum() if entropy_grad else 0.0
        return (coefficients[0] * log_probs).sum() + entropy_term

    grads = _grads(inputs, loss(log_probs, entropies))
    expected = _grads(inputs, loss(expected_log_probs, expected_entropies))
    for grad, expected_grad in zip(grads, expected):
        torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("entropy_top_k", [0, 4])
@pytest.mark.parametrize("spread_top_k", [3, 11])
def test_chunked_spread_term_equals_its_reference_in_values_and_gradients(chunk, entropy_top_k, spread_top_k):
    # the collapse-recovery term KL(u_K || p) (core_algos.spread_from_logits) as a third output, with
    # the log-prob and a differentiable entropy in the same loss; 11 = the whole vocabulary
    generator = torch.Generator().manual_seed(2)
    hidden = (0.3 * torch.randn(2, 5, 8, generator=generator)).requires_grad_()
    weight = torch.randn(11, 8, generator=generator, requires_grad=True)
    bias = torch.randn(11, generator=generator, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5), generator=generator)
    coefficients = torch.randn(3, 2, 5, generator=generator)
    scoring = TokenScoring(
        targets, TEMPERATURE, chunk, True, entropy_top_k=entropy_top_k, spread_top_k=spread_top_k
    )
    outputs = chunked_token_scores(hidden, weight, bias, scoring)
    logits = torch.nn.functional.linear(hidden, weight, bias) / TEMPERATURE
    expected = (
        log_probs_from_logits(logits, targets),
        entropy_from_logits(logits, entropy_top_k),
        spread_from_logits(logits, spread_top_k),
    )
    for output, reference in zip(outputs, expected):
        torch.testing.assert_close(output, reference, atol=1e-5, rtol=1e-5)
    assert (outputs[2] >= -1e-6).all()
    inputs = [hidden, weight, bias]
    grads = _grads(inputs, sum((c * o).sum() for c, o in zip(coefficients, outputs)))
    expected_grads = _grads(inputs, sum((c * o).sum() for c, o in zip(coefficients, expected)))
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-5)
    head = TokenScoringHead.replacing(torch.nn.Linear(8, 11))
    head.scoring = scoring
    assert head(hidden).shape == (2, 5, 4)  # log-prob, entropy, spread, whole-vocabulary entropy


def test_chunked_scores_in_bf16_follow_the_fp32_ones():
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 16, generator=generator)
    weight = torch.randn(50, 16, generator=generator) / 4
    targets = torch.randint(0, 50, (6,), generator=generator)
    expected = _reference_scores(hidden, weight, None, targets, TEMPERATURE)
    low = [tensor.bfloat16().requires_grad_() for tensor in (hidden, weight)]
    log_probs, entropies, _, _ = chunked_token_scores(*low, None, TokenScoring(targets, TEMPERATURE, 4, True))
    assert log_probs.dtype == torch.float32
    torch.testing.assert_close(log_probs, expected[0], atol=0.1, rtol=0.02)
    torch.testing.assert_close(entropies, expected[1], atol=0.1, rtol=0.02)
    grads = _grads(low, log_probs.sum() + entropies.sum())
    assert [grad.dtype for grad in grads] == [torch.bfloat16, torch.bfloat16]
    assert all(torch.isfinite(grad).all() for grad in grads)


def test_the_head_holds_the_same_parameters_and_is_plain_outside_scoring(tiny_vl_path, tiny_omni_path):
    for path, tied in ((tiny_vl_path, True), (tiny_omni_path, False)):
        plain = training_model(str(path), role="critic")  # the value head stays a plain Linear
        assert token_scoring_head(plain) is None
        model = training_model(str(path))
        head = token_scoring_head(model)
        assert isinstance(head, TokenScoringHead) and head.scoring is None
        assert (head.weight is model.get_input_embeddings().weight) == tied
        assert install_token_scoring_head(model).get_output_embeddings() is head  # idempotent
        hidden = torch.randn(3, head.in_features)
        torch.testing.assert_close(head(hidden), hidden @ head.weight.T)
        assert "lm_head.weight" in dict(model.named_parameters()) or tied  # the names vLLM sync reads
    with (
        pytest.raises(RuntimeError, match="score_tokens=True"),
        scoring_tokens(plain, torch.zeros(1), 1.0, 4),
    ):
        pass


def _scored_and_reference(model, batch, padding_free, share_prompts, entropy_grad):
    """(log-probs, entropies) [K] through the scoring head and through the plain head's logits."""
    args = forward_arguments(batch)
    common = {"padding_free": padding_free, "share_prompts": share_prompts}
    scores, response_valid = response_token_outputs(
        model, *args, **common, scoring=ResponseScoring(TEMPERATURE, CHUNK, entropy_grad)
    )
    logits, _ = response_token_outputs(model, *args, **common)
    tokens = batch.batch["responses"][response_valid]
    logits = logits / TEMPERATURE
    return (scores[:, 0], scores[:, 1]), (log_probs_from_logits(logits, tokens), entropy_from_logits(logits))


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen2_5_omni"])
@pytest.mark.parametrize(
    ("padding_free", "share_prompts"),
    [(False, False), (True, False), (True, True)],
    ids=["padded", "packed", "shared"],
)
def test_model_scores_equal_the_logits_path_in_values_and_every_gradient(
    kind, padding_free, share_prompts, tiny_vl_path, tiny_omni_path
):
    from transformers import AutoProcessor

    path = str(tiny_vl_path if kind == "qwen2_5_vl" else tiny_omni_path)
    model = training_model(path)
    batch = build_batch(AutoProcessor.from_pretrained(path), ROWS, RESPONSE_LENGTHS, seed=3)
    (log_probs, entropies), (expected_log_probs, expected_entropies) = _scored_and_reference(
        model, batch, padding_free, share_prompts, entropy_grad=True
    )
    assert log_probs.shape == (sum(RESPONSE_LENGTHS),)
    torch.testing.assert_close(log_probs, expected_log_probs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropies, expected_entropies, atol=1e-5, rtol=1e-5)

    coefficients = torch.randn(2, len(log_probs), generator=torch.Generator().manual_seed(4))
    params = [param for param in model.parameters() if param.requires_grad]
    names = [name for name, param in model.named_parameters() if param.requires_grad]
    grads = _grads(params, (coefficients[0] * log_probs + coefficients[1] * entropies).sum())
    expected = _grads(
        params, (coefficients[0] * expected_log_probs + coefficients[1] * expected_entropies).sum()
    )
    # the head's weight (the embedding matrix when tied) and everything below it, through the hidden states
    assert "lm_head.weight" in names or kind == "qwen2_5_vl"
    for name, grad, expected_grad in zip(names, grads, expected):
        assert (grad is None) == (expected_grad is None), name
        if grad is not None:
            torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-4, msg=name)
    assert any(
        "visual" in name and grad is not None and grad.abs().sum() > 0 for name, grad in zip(names, grads)
    )


class _LargestVocabTensor(TorchDispatchMode):
    """Records the largest number of rows of any tensor an op allocates (views and in-place results,
    which share an input's storage, are not new memory) whose last dim is the vocabulary."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size, self.max_rows = vocab_size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [arg for arg in (*args, *kwargs.values()) if isinstance(arg, torch.Tensor)]
        input_storages = {tensor.untyped_storage().data_ptr() for tensor in inputs}
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if (
                not isinstance(tensor, torch.Tensor)
                or tensor.dim() == 0
                or tensor.shape[-1] != self.vocab_size
            ):
                continue
            if tensor.untyped_storage().data_ptr() not in input_storages:
                self.max_rows = max(self.max_rows, tensor.numel() // self.vocab_size)
        return out


@pytest.mark.parametrize("chunk_tokens", [CHUNK, 0])
def test_no_tensor_holds_every_token_times_the_vocabulary(tiny_vl_path, chunk_tokens):
    """Forward and backward of a scored pass create [chunk, vocab] tensors at most; the unchunked
    logits path (``chunk_tokens`` 0) creates [K, vocab] ones, which the check would see."""
    from transformers import AutoProcessor

    model = training_model(str(tiny_vl_path))
    vocab_size = model.get_output_embeddings().out_features
    batch = build_batch(AutoProcessor.from_pretrained(str(tiny_vl_path)), ROWS, RESPONSE_LENGTHS, seed=3)
    num_tokens = sum(RESPONSE_LENGTHS)
    recorder = _LargestVocabTensor(vocab_size)
    with recorder:
        if chunk_tokens:
            scores, _ = response_token_outputs(
                model,
                *forward_arguments(batch),
                padding_free=True,
                scoring=ResponseScoring(TEMPERATURE, chunk_tokens, entropy_grad=True),
            )
            loss = scores.sum()
        else:
            logits, valid = response_token_outputs(model, *forward_arguments(batch), padding_free=True)
            loss = log_probs_from_logits(logits / TEMPERATURE, batch.batch["responses"][valid]).sum()
        loss.backward()
    if chunk_tokens:
        assert recorder.max_rows <= chunk_tokens
    else:
        assert recorder.max_rows >= num_tokens


# (dtype, chunk, bias, entropy_grad, entropy_top_k, spread_top_k) over 10 rows: a partial last chunk
COMPILED_CASES = (
    (torch.float32, 3, True, True, 0, 0),
    (torch.float32, 4, False, False, 4, 3),
    (torch.bfloat16, 4, False, True, 0, 0),
)


def _scores_and_grads(chunk_math, dtype, chunk, with_bias, entropy_grad, top_k, spread_k):
    generator = torch.Generator().manual_seed(3)
    hidden = (0.3 * torch.randn(10, 8, generator=generator)).to(dtype).requires_grad_()
    weight = torch.randn(11, 8, generator=generator).to(dtype).requires_grad_()
    bias = torch.randn(11, generator=generator).to(dtype).requires_grad_() if with_bias else None
    targets = torch.randint(0, 11, (10,), generator=generator)
    coefficients = torch.randn(3, 10, generator=generator)
    scoring = TokenScoring(
        targets, TEMPERATURE, chunk, entropy_grad, entropy_top_k=top_k, spread_top_k=spread_k
    )
    outputs = chunked_token_scores(hidden, weight, bias, scoring, chunk_math)
    inputs = [hidden, weight] + ([bias] if with_bias else [])
    differentiable = [outputs[0]] + [outputs[1]] * entropy_grad + [outputs[2]] * (spread_k > 0)
    loss = sum((c * o).sum() for c, o in zip(coefficients, differentiable))
    return outputs, _grads(inputs, loss)


@pytest.mark.parametrize("backend", ["counting", "inductor"])
def test_compiled_chunk_math_equals_the_eager_ops(backend):
    """``compile_head``'s chunk math (``compiled_chunk_math``): the values and gradients of the eager
    ops, in fp32 and bf16, with a partial last chunk (a second shape), a bias, a differentiable or
    logged entropy, a top-k entropy and the spread term. ``counting``: the compiler's capture and
    functionalization of the in-place ops, and the compiled graphs ran for every chunk each way;
    ``inductor`` also generates the fused kernels (one case: the compiler's C++ builds)."""
    from torch._dynamo.utils import counters

    from mmrl.models.compiled import compiled_chunk_math
    from mmrl.models.token_scoring import EAGER_CHUNK_MATH

    counting = CountingBackend()
    compiled = compiled_chunk_math(counting.backend if backend == "counting" else backend)
    counters.clear()
    cases = COMPILED_CASES[:1] if backend == "inductor" else COMPILED_CASES
    for case in cases:
        expected_outputs, expected_grads = _scores_and_grads(EAGER_CHUNK_MATH, *case)
        outputs, grads = _scores_and_grads(compiled, *case)
        tolerance = {"atol": 1e-5, "rtol": 1e-5} if case[0] == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
        for output, expected in zip(outputs, expected_outputs):
            torch.testing.assert_close(output, expected, **tolerance)
        for grad, expected in zip(grads, expected_grads):
            assert grad.dtype == case[0]
            torch.testing.assert_close(grad, expected, **tolerance)
    assert counters["stats"]["unique_graphs"] >= 2  # both functions compiled
    if backend == "counting":  # no-grad graphs (inside the autograd function) count as forward ones
        chunks = sum(-(-10 // case[1]) for case in cases)  # each case's chunks of its 10 rows
        assert counting.calls["forward"] == 2 * chunks  # the scores forward, the logit gradient backward


def test_no_rows_score_nothing_and_pass_no_gradient():
    hidden = torch.zeros(0, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    scoring = TokenScoring(torch.zeros(0, dtype=torch.long), TEMPERATURE, 4, True)
    outputs = chunked_token_scores(hidden, weight, None, scoring)
    assert [tuple(output.shape) for output in outputs] == [(0,)] * 4
    grads = _grads([hidden, weight], outputs[0].sum() + outputs[1].sum())
    assert grads[0].shape == (0, 8) and not grads[1].any()
