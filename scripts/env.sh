# Set up (once) and activate the project's virtualenv: torch 2.13.0 (CPU), the package and its
# test extras. Sourced by scripts/demo.sh and scripts/test.sh; safe to run again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DYNAMO_DIST_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch, transformers, pytest, rich, dynamo_dist" 2>/dev/null; then
  "$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0
  "$VENV/bin/pip" install -q --disable-pip-version-check -e "$ROOT[test]"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
