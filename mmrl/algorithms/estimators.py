"""The advantage estimators whose maths lives in :mod:`mmrl.core_algos.advantages`."""

from mmrl.algorithms.spec import AdvantageSpec, register

MATHS = "mmrl.core_algos.advantages"

# advantages relative to the other responses of the same prompt
register(AdvantageSpec("grpo", f"{MATHS}:compute_grpo_advantages", needs_groups=True))
register(AdvantageSpec("grpo_passk", f"{MATHS}:compute_grpo_passk_advantages", needs_groups=True))
register(AdvantageSpec("rloo", f"{MATHS}:compute_rloo_advantages", needs_groups=True))
# returns-to-go whitened over the batch
register(AdvantageSpec("reinforce_plus_plus", f"{MATHS}:compute_reinforce_plus_plus_advantages"))
# the greedy response's score as each prompt's baseline
register(AdvantageSpec("remax", f"{MATHS}:compute_remax_advantages", greedy_baseline=True))
# a critic's values
register(AdvantageSpec("gae", f"{MATHS}:compute_gae_advantages", needs_critic=True))
