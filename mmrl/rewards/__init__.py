"""Reward sources and their composition: what turns a batch of responses into rewards.

- :mod:`mmrl.rewards.source`: the interface every source implements (reward inputs in, one score dict
  or :class:`~mmrl.rewards.source.SampleFailure` per sample out);
- :mod:`mmrl.rewards.rule`: the user's Python reward file (EasyR1's contract);
- :mod:`mmrl.rewards.code`: the response's program run against the row's test cases, in
  :mod:`mmrl.sandbox`;

Sources run inside the reward worker processes (:mod:`mmrl.rewards.scorer`: responses decoded by the
driver in, score dicts out; :mod:`mmrl.workers.reward_worker` is the driver's side, which places the
scores on the tokens). Nothing here imports Ray or torch at the top; HTTP clients, servers and models
are imported where a source that needs them is built.
"""
