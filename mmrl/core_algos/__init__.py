"""RL algorithms as pure tensor functions: advantages, policy/value losses, loss aggregation, KL, entropy.

One module per topic:

- :mod:`~mmrl.core_algos.advantages`: advantage estimators (GRPO, pass@k, RLOO, REINFORCE++, ReMax, GAE);
- :mod:`~mmrl.core_algos.policy_losses`: policy losses (PPO, GSPO, GSPO-token, CISPO, SAPO, Clip-Cov,
  KL-Cov), each reading its knobs from the actor's loss section (:class:`~mmrl.config.PolicyLossConfig`);
- :mod:`~mmrl.core_algos.aggregation`: a per-token loss reduced to a scalar, split-invariant;
- :mod:`~mmrl.core_algos.kl`: KL estimators, the KL reward penalty and its controllers;
- :mod:`~mmrl.core_algos.entropy`: the entropy bonus's coefficient controller (Skywork-OR1);
- :mod:`~mmrl.core_algos.collapse`: collapse signs (all-equal groups) and the recovery term's gate;
- :mod:`~mmrl.core_algos.step_size`: the learning rate scaled down while updates move the policy too far;
- :mod:`~mmrl.core_algos.logits`: log-probs and entropies (whole-vocabulary or top-k) from logits;
- :mod:`~mmrl.core_algos.value`, :mod:`~mmrl.core_algos.shaping`: the critic's loss, reward shaping;
- :mod:`~mmrl.core_algos.masked`, :mod:`~mmrl.core_algos.registry`: masked reductions, name registries.

- :mod:`~mmrl.core_algos.rollout_correction`: weights on the per-token policy loss that correct for
  the rollout engine's probabilities not being the trainer's (truncated importance sampling, rejection).
- :mod:`~mmrl.core_algos.off_policy`: weights on it for tokens an older policy sampled
  (``algorithm.off_policy``: decoupled PPO).

Conventions shared by every function here:

- Token tensors are ``[B, L]`` over the response part of each sample; ``response_mask`` ``[B, L]`` is 1
  for response tokens up to and including EOS and 0 for padding.
- Outcome rewards arrive as ``token_level_rewards`` ``[B, L]`` with the sequence's score on its last
  valid token (as in EasyR1/verl); outcome estimators sum them over the mask to get the score ``[B]``.
- ``index`` holds the prompt uid of every response (list or numpy object array, length ``B``).
  Groups are formed by uid, never by position, so responses may arrive in any order.
- Policy/value losses return a per-token loss ``[B, L]`` plus per-token diagnostics; reducing them to
  a scalar is a separate step, :func:`aggregate_loss`, chosen by name.

A config string selects an algorithm through the registries ``ADV_ESTIMATORS``, ``POLICY_LOSSES``,
``LOSS_AGG_MODES`` and ``KL_ESTIMATORS`` and their ``get_*`` functions; estimators and losses are
registered as specs in :mod:`mmrl.algorithms` (the first two are views of those). Nothing here calls
``torch.distributed``; the only config objects read are the sections handed in as options.
"""

from mmrl.core_algos.advantages import (
    compute_gae_advantages,
    compute_grpo_advantages,
    compute_grpo_passk_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
)
from mmrl.core_algos.aggregation import LOSS_AGG_MODES, aggregate_loss
from mmrl.core_algos.collapse import CollapseGate, all_equal_groups
from mmrl.core_algos.entropy import EntropyController
from mmrl.core_algos.kl import (
    KL_CONTROLLER_TYPES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_abs,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty,
)
from mmrl.core_algos.logits import entropy_from_logits, log_probs_from_logits, spread_from_logits
from mmrl.core_algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from mmrl.core_algos.policy_losses import (
    LOG_RATIO_CLAMP,
    POLICY_LOSS_CLIP_DEFAULTS,
    compute_cispo_policy_loss,
    compute_clip_cov_policy_loss,
    compute_gspo_policy_loss,
    compute_gspo_token_policy_loss,
    compute_kl_cov_policy_loss,
    compute_policy_loss,
    compute_ppo_policy_loss,
    compute_sapo_policy_loss,
    policy_clip_range,
)
from mmrl.core_algos.registry import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    get_adv_estimator,
    get_kl_estimator,
    get_policy_loss,
)
from mmrl.core_algos.rollout_correction import (
    ROLLOUT_IS_LEVELS,
    ROLLOUT_RS_LEVELS,
    rollout_correction_weights,
)
from mmrl.core_algos.shaping import overlong_penalty
from mmrl.core_algos.step_size import KLStepControl
from mmrl.core_algos.value import compute_value_loss

__all__ = [
    "ADV_ESTIMATORS",
    "KL_CONTROLLER_TYPES",
    "KL_ESTIMATORS",
    "LOG_RATIO_CLAMP",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "POLICY_LOSS_CLIP_DEFAULTS",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_RS_LEVELS",
    "AdaptiveKLController",
    "CollapseGate",
    "EntropyController",
    "FixedKLController",
    "KLStepControl",
    "aggregate_loss",
    "all_equal_groups",
    "apply_kl_penalty",
    "build_kl_controller",
    "compute_cispo_policy_loss",
    "compute_clip_cov_policy_loss",
    "compute_gae_advantages",
    "compute_grpo_advantages",
    "compute_grpo_passk_advantages",
    "compute_gspo_policy_loss",
    "compute_gspo_token_policy_loss",
    "compute_kl_cov_policy_loss",
    "compute_policy_loss",
    "compute_ppo_policy_loss",
    "compute_reinforce_plus_plus_advantages",
    "compute_remax_advantages",
    "compute_rloo_advantages",
    "compute_sapo_policy_loss",
    "compute_value_loss",
    "entropy_from_logits",
    "get_adv_estimator",
    "get_kl_estimator",
    "get_policy_loss",
    "kl_abs",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "policy_clip_range",
    "rollout_correction_weights",
    "spread_from_logits",
]
