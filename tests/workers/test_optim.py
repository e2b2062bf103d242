"""AdamW with bfloat16 moments (``optim.strategy: adamw_bf16``) against torch.optim.AdamW: values,
hyper-parameters, unbiased rounding, state_dict round trip. Its 2-rank FSDP2 update is checked in
``test_fsdp_engine.py`` (``two_rank_results``)."""

from __future__ import annotations

import io

import pytest
import torch

from mmrl.workers.fsdp_engine import build_optimizer
from mmrl.workers.optim import AdamWBf16, round_to_bf16_stochastically_, rounding_noise

HYPER = {"lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.1}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    # a 2-D weight, a vector, and a tensor over CHUNK_ELEMENTS would need 4M elements: chunking is
    # covered by test_chunked_update_equals_one_chunk
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((32, 48), (7,))]


def _run(optimizer_cls, steps: int, seed: int = 0, **hyper):
    params = _params(seed)
    optimizer = optimizer_cls(params, **{**HYPER, **hyper})
    generator = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    return params, optimizer


def test_registered_as_adamw_bf16_with_the_configured_hyper_parameters():
    optimizer = build_optimizer(
        _params(), lr=1e-3, betas=[0.9, 0.95], weight_decay=0.05, strategy="adamw_bf16"
    )
    assert isinstance(optimizer, AdamWBf16)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-3, (0.9, 0.95), 0.05)


def test_one_step_equals_adamw_and_several_stay_within_bf16_tolerance():
    # step 1: m = (1 - b1) g and v = (1 - b2) g^2 are computed in float32 before any rounding: the
    # parameters equal AdamW's to float32 precision. Later steps start from moments rounded to bf16
    # (relative error <= 2^-8), so the update differs by ~1 % of its size: lr = 1e-2 per step.
    params, _ = _run(AdamWBf16, 1)
    reference, _ = _run(torch.optim.AdamW, 1)
    for param, expected in zip(params, reference):
        torch.testing.assert_close(param.detach(), expected.detach(), rtol=1e-6, atol=1e-7)
    params, optimizer = _run(AdamWBf16, 6)
    reference, reference_optimizer = _run(torch.optim.AdamW, 6)
    initial = _params()
    for param, expected, start in zip(params, reference, initial):
        torch.testing.assert_close(param.detach(), expected.detach(), rtol=0, atol=6 * 1e-2 * 0.03)
        assert (param.detach() - start.detach()).abs().mean() > 1e-2  # not vacuous: it moved
        state, expected_state = optimizer.state[param], reference_optimizer.state[expected]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        assert float(state["step"]) == 6.0
        # stochastic rounding errs by up to one bf16 step (2^-7 relative) per update, not half of one
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[key].float(), expected_state[key], rtol=3e-2, atol=1e-2)


def test_weight_decay_and_betas_are_honoured():
    # zero gradients: m = v = 0, the Adam step is 0 / (0 + eps) = 0, only the decay acts: p * (1 - lr wd)^3
    params = _params()
    start = [param.detach().clone() for param in params]
    optimizer = AdamWBf16(params, **HYPER)
    for _ in range(3):
        for param in params:
            param.grad = torch.zeros_like(param)
        optimizer.step()
    for param, before in zip(params, start):
        torch.testing.assert_close(param.detach(), before * (1 - 1e-2 * 0.1) ** 3, rtol=1e-6, atol=0)
    # other betas give another trajectory, matched by AdamW with the same betas (first step: exact)
    for betas in ((0.5, 0.6), (0.99, 0.9999)):
        params, _ = _run(AdamWBf16, 2, betas=betas)
        reference, _ = _run(torch.optim.AdamW, 2, betas=betas)
        for param, expected in zip(params, reference):
            torch.testing.assert_close(param.detach(), expected.detach(), rtol=0, atol=2 * 1e-2 * 0.03)


def test_stochastic_rounding_is_unbiased_where_round_to_nearest_is_stuck():
    # 1 + 2^-10 lies 1/8 of a bf16 step (2^-7) above 1: round-to-nearest gives 1 every time, stochastic
    # rounding gives 1 + 2^-7 with probability 1/8, so the mean is 1 + 2^-10 (std of the mean ~3e-5)
    values = torch.full((200_000,), 1.0 + 2**-10)
    noise = rounding_noise(200_000, torch.device("cpu"), step=1)
    rounded = round_to_bf16_stochastically_(values.clone(), noise[0])
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert rounded.mean().item() == pytest.approx(1.0 + 2**-10, abs=2e-4)
    assert torch.equal(rounded.to(torch.bfloat16).float(), rounded)  # exactly representable
    assert values.to(torch.bfloat16).float().mean().item() == 1.0
    negative = round_to_bf16_stochastically_(-values, noise[1])
    assert negative.mean().item() == pytest.approx(-(1.0 + 2**-10), abs=2e-4)
    exact = torch.tensor([0.0, 1.5, -2.0, 3.0e-20]).to(torch.bfloat16).float()  # come back unchanged
    assert torch.equal(round_to_bf16_stochastically_(exact.clone(), noise[0, :4]), exact)
    assert torch.equal(rounding_noise(8, torch.device("cpu"), 3), rounding_noise(8, torch.device("cpu"), 3))
    assert not torch.equal(
        rounding_noise(8, torch.device("cpu"), 3), rounding_noise(8, torch.device("cpu"), 4)
    )


def test_second_moment_follows_float32_where_round_to_nearest_freezes_it():
    # g^2 = 1 for 400 steps: v = 1 - 0.999^400 = 0.3297; then g = 0 for 400 steps: v = 0.3297 * 0.999^400
    # = 0.2210. In bf16 with round-to-nearest v stops at 0.25 after ~290 steps (a step's change, < 0.1 %,
    # is below half a bf16 step) and stays there (checked: 0.25 at steps 400 and 800). Stochastic
    # rounding follows the float32 value in expectation.
    param = torch.nn.Parameter(torch.zeros(4_000))
    optimizer = AdamWBf16([param], lr=0.0, betas=(0.9, 0.999), weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 800 tiny steps: a second thread only adds hand-over waits (~50x slower)
    try:
        _alternate_gradients(param, optimizer)
    finally:
        torch.set_num_threads(threads)
    mean = optimizer.state[param]["exp_avg_sq"].float().mean().item()
    assert mean == pytest.approx((1 - 0.999**400) * 0.999**400, rel=0.02)


def _alternate_gradients(param, optimizer) -> None:
    for step in range(800):
        param.grad = torch.ones_like(param) if step < 400 else torch.zeros_like(param)
        optimizer.step()
        if step == 399:
            mean = optimizer.state[param]["exp_avg_sq"].float().mean().item()
            assert mean == pytest.approx(1 - 0.999**400, rel=0.01)


def test_chunked_update_equals_one_chunk(monkeypatch):
    # the first step is exact whatever the chunking; later ones draw their rounding noise per chunk,
    # so they agree within the bf16 tolerance
    from mmrl.workers import optim

    whole = {steps: _run(AdamWBf16, steps)[0] for steps in (1, 3)}
    monkeypatch.setattr(optim, "CHUNK_ELEMENTS", 100)  # the (32, 48) weight in 16 chunks, the last partial
    for steps, atol in ((1, 1e-7), (3, 3 * 1e-2 * 0.03)):
        for param, expected in zip(_run(AdamWBf16, steps)[0], whole[steps]):
            torch.testing.assert_close(param.detach(), expected.detach(), rtol=0, atol=atol)


def test_state_dict_round_trip_resumes_to_the_same_numbers():
    # 3 steps, save, load into a fresh optimizer over a copy of the parameters, 2 more steps on both:
    # identical (the rounding noise is seeded by the step, so a resumed run rounds the same way)
    params, optimizer = _run(AdamWBf16, 3)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    copies = [torch.nn.Parameter(param.detach().clone()) for param in params]
    resumed = AdamWBf16(copies, **HYPER)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer))
    for state in resumed.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16  # not cast to fp32
    generator = torch.Generator().manual_seed(7)
    for _ in range(2):
        for original, copy in zip(params, copies):
            original.grad = torch.randn(original.shape, generator=generator)
            copy.grad = original.grad.clone()
        optimizer.step()
        resumed.step()
    for original, copy in zip(params, copies):
        assert torch.equal(original.detach(), copy.detach())
        assert torch.equal(optimizer.state[original]["exp_avg_sq"], resumed.state[copy]["exp_avg_sq"])
