"""Agentic rollouts: multi-turn trajectories whose tools and environments answer with text, images,
video and audio.

The agent loop (:mod:`mmrl.agent.loop`) drives a rollout backend's turn generation (the interface of
:mod:`mmrl.agent.backend`, which both backends implement; the worker hands the loop its backend): it
samples a model turn, parses its tool calls (the model family's format, :mod:`mmrl.agent.parsing`),
runs them (:mod:`mmrl.agent.tools`, off the generating thread, bounded and with timeouts) or steps an
environment (:mod:`mmrl.agent.environments`), appends the chat template's observation turn as token
ids, and goes on until a final answer, ``max_turns`` or the response budget. A trajectory becomes a
training batch row by :func:`~mmrl.agent.trajectory.assemble_trajectory_batch`: a response with holes
in its mask (:mod:`mmrl.columns`).
"""
