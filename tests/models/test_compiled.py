"""Compiled decoder layers (mmrl.models.compiled): the compiled code runs and the update is the eager
one's, with and without gradient checkpointing (the compiled forward then runs again in the backward);
new layouts of packed rows compile nothing new; layers routing tokens to experts, and decoders carrying
a state along each sequence, stay eager."""

from __future__ import annotations

import pytest
import torch
from _batches import ACTOR_SETTINGS, TEMPERATURE, add_training_columns, build_batch, policy_actor
from _compiling import CountingBackend
from _models import training_model

from mmrl.models.compiled import RECOMPILE_LIMIT, compile_layers, compiled_layers
from mmrl.models.loading import decoder_layers
from mmrl.workers.fsdp_engine import enable_gradient_checkpointing

ROWS = [{"image": (56, 56)}, {}, {"image": (28, 56)}, {}]


@pytest.fixture(scope="module")
def batches(tiny_vl_path):
    """Image and text rows of uneven lengths (packed; the text rows share their prompt), in six
    layouts: 4, 6, 2, 5, 3 and 3 rows, so the number of sequences and of shared-prompt groups changes;
    the third and the last hold text rows only."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    layouts = (
        (ROWS, [5, 7, 3, 6]),
        ([{}, {}, {"image": (56, 28)}, {}, {}, {}], [4, 2, 8, 6, 3, 5]),
        ([{}, {}], [6, 1]),
        ([{"image": (28, 28)}, {}, {}, {}, {"image": (56, 56)}], [2, 7, 7, 4, 5]),
        ([{"image": (56, 28)}, {"image": (28, 28)}, {}], [3, 8, 2]),
        ([{}, {}, {}], [2, 5, 7]),
    )
    return [
        add_training_columns(build_batch(processor, rows, lengths, seed=seed), tiny_vl_path)
        for seed, (rows, lengths) in enumerate(layouts)
    ]


def _actor(model_path, checkpointing: bool, backend=None, recomputed: int | None = None):
    torch.manual_seed(0)
    model = training_model(model_path)
    if checkpointing:
        enable_gradient_checkpointing(model, recomputed)
    if backend is not None:
        assert compile_layers(model, backend) == len(decoder_layers(model))
    model.train()
    return model, policy_actor(model, torch.optim.SGD(model.parameters(), lr=0.1), **ACTOR_SETTINGS)


def _update(actor, batch) -> dict:
    return actor.update_policy(batch, len(batch), 2, ppo_epochs=1, temperature=TEMPERATURE).metrics


def _layer_forwards(model) -> list[int]:
    """Counts, per decoder layer, of its forward runs (a recomputation in the backward included)."""
    counts = [0] * len(decoder_layers(model))
    for index, layer in enumerate(decoder_layers(model)):
        layer.register_forward_pre_hook(lambda *_, index=index: counts.__setitem__(index, counts[index] + 1))
    return counts


# (checkpointing, decoder layers recomputed): none, every layer's (null), the first layer's only
SETTINGS = {"off": (False, None), "all": (True, None), "first": (True, 1)}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_compiled_layers_run_and_give_the_eager_update(tiny_vl_path, batches, setting):
    """Eager and compiled, with every layer, one or none recomputing its activations in the backward
    (``gradient_checkpointing_layers``): the same update as the eager one without checkpointing."""
    import torch._dynamo

    checkpointing, recomputed = SETTINGS[setting]
    torch._dynamo.reset()
    counting = CountingBackend()
    reference_model, reference = _actor(tiny_vl_path, False)
    reference_metrics = _update(reference, batches[0])
    eager_model, eager_actor = _actor(tiny_vl_path, checkpointing, recomputed=recomputed)
    forwards = _layer_forwards(eager_model)
    eager_metrics = _update(eager_actor, batches[0])
    model, actor = _actor(tiny_vl_path, checkpointing, counting.backend, recomputed)
    metrics = _update(actor, batches[0])
    for name in ("pg_loss", "grad_norm", "entropy"):
        assert eager_metrics[name] == pytest.approx(reference_metrics[name], rel=1e-5, abs=1e-7), name
        assert metrics[name] == pytest.approx(eager_metrics[name], rel=1e-5, abs=1e-7), name
    for (name, weight), eager_weight, reference_weight in zip(
        model.named_parameters(), eager_model.parameters(), reference_model.parameters()
    ):
        torch.testing.assert_close(eager_weight, reference_weight, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(weight, eager_weight, rtol=1e-5, atol=1e-6, msg=name)
    # per micro-batch, a recomputing layer's forward ran twice (once more in the backward), the others once
    layers = len(decoder_layers(model))
    recomputing = 0 if not checkpointing else layers if recomputed is None else recomputed
    assert forwards == [4] * recomputing + [2] * (layers - recomputing)
    # every layer ran compiled in each micro-batch's forward and backward, as two graphs (before and
    # after its eager packed attention); a recomputing layer's forward once more in the backward
    assert counting.calls["backward"] >= layers * 2 * 2
    assert counting.calls["forward"] * layers == counting.calls["backward"] * (layers + recomputing)


def test_new_layouts_of_packed_rows_compile_nothing_new(tiny_vl_path, batches):
    """Each batch's no-grad log-prob pass and update (one micro-batch: every row packed together)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _, eager_actor = _actor(tiny_vl_path, True)
    _, actor = _actor(tiny_vl_path, True, CountingBackend().backend)
    graphs = []
    for batch in batches:
        expected, _ = eager_actor.compute_log_probs(batch, len(batch), TEMPERATURE)
        log_probs, _ = actor.compute_log_probs(batch, len(batch), TEMPERATURE)
        torch.testing.assert_close(log_probs, expected, rtol=1e-5, atol=1e-5)
        expected = eager_actor.update_policy(batch, len(batch), len(batch), 1, TEMPERATURE).metrics
        metrics = actor.update_policy(batch, len(batch), len(batch), 1, TEMPERATURE).metrics
        assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    # the first layouts compile (static token counts, then dynamic ones; rows with media and text rows
    # only: inputs that need a gradient or not); the rows' lengths and groups are never guarded on, so
    # a new layout of a kind already seen reuses the graphs (the fourth after the third, the last after
    # the fifth), and what the graphs grow by stays far under the compiler's limit per layer call
    assert graphs[0] > 0 and graphs[3] == graphs[2] and graphs[5] == graphs[4], graphs
    assert graphs[5] < RECOMPILE_LIMIT, graphs


def test_layers_routing_to_experts_or_carrying_a_sequence_state_stay_eager(
    tiny_vl_path, tiny_qwen3_vl_moe_path, tiny_qwen3_5_path
):
    from mmrl.models.loading import load_model

    assert compiled_layers(load_model(str(tiny_qwen3_vl_moe_path))) == []  # every layer is a MoE layer
    assert compiled_layers(load_model(str(tiny_qwen3_5_path))) == []  # linear attention, per sequence
    dense = load_model(str(tiny_vl_path))
    assert compiled_layers(dense) == list(decoder_layers(dense))


def test_a_compiled_head_gives_the_eager_update_and_log_probs(tiny_vl_path, batches):
    """``compile_head``: the log-prob head's chunk math compiled (the compiler's capture, no code
    generation here; tests/models/test_token_scoring.py generates it), with chunks of 4 response tokens
    (several per micro-batch, the last partial): the no-grad log-probs, the update's metrics and every
    weight equal the eager head's; the compiled math ran in the forward and in the backward. A model
    without the head (a critic's value head) is left as it is."""
    import torch._dynamo

    from mmrl.models.compiled import compile_head
    from mmrl.models.token_scoring import EAGER_CHUNK_MATH, token_scoring_head

    torch._dynamo.reset()
    counting = CountingBackend()
    settings = {**ACTOR_SETTINGS, "log_prob_chunk_tokens": 4}
    models, actors = [], []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = training_model(tiny_vl_path)
        if compiled:
            assert compile_head(model, counting.backend)
            assert token_scoring_head(model).chunk_math is not EAGER_CHUNK_MATH
        model.train()
        models.append(model)
        actors.append(policy_actor(model, torch.optim.SGD(model.parameters(), lr=0.1), **settings))
    expected, _ = actors[0].compute_log_probs(batches[0], 2, TEMPERATURE)
    log_probs, _ = actors[1].compute_log_probs(batches[0], 2, TEMPERATURE)
    torch.testing.assert_close(log_probs, expected, rtol=1e-5, atol=1e-5)
    scored = counting.calls["forward"]
    assert scored >= 2  # a chunk's scores per micro-batch, at least
    expected_metrics, metrics = (_update(actor, batches[0]) for actor in actors)
    for name in ("pg_loss", "grad_norm", "entropy"):
        assert metrics[name] == pytest.approx(expected_metrics[name], rel=1e-5, abs=1e-7), name
    for (name, weight), eager_weight in zip(models[1].named_parameters(), models[0].parameters()):
        torch.testing.assert_close(weight, eager_weight, rtol=1e-5, atol=1e-6, msg=name)
    # the update ran the compiled scores (forward) and logit gradients (backward) of the same chunks
    assert counting.calls["forward"] == 3 * scored
    assert not compile_head(training_model(tiny_vl_path, role="critic"))
