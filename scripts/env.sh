# Set up (once) and activate the project's virtualenv: torch 2.13.0 (CPU), the package and its
# test extras. Sourced by scripts/demo.sh and scripts/test.sh; safe to run again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DYNAMO_DIST_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch, transformers, pytest, xdist, rich, dynamo_dist, torchtitan" 2>/dev/null; then
  "$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0
  "$VENV/bin/pip" install -q --disable-pip-version-check -e "$ROOT[test]"
  # torchtitan's Llama 3 and its own TP plan (tests/mp/torchtitan_tp.py), without its
  # training-loop dependencies (datasets, wandb, tensorboard); it imports triton at import
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps torchtitan==0.3.0 \
    spmd_types==0.3.1 tyro==1.0.17 docstring_parser==0.18.0 triton==3.9.0
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
