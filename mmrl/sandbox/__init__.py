"""Sandboxed execution of untrusted programs (model-written code): see :mod:`mmrl.sandbox.runner`."""

from mmrl.sandbox.runner import ISOLATIONS, Program, RunResult, Sandbox, SandboxError, SandboxLimits

__all__ = ["ISOLATIONS", "Program", "RunResult", "Sandbox", "SandboxError", "SandboxLimits"]
