#!/usr/bin/env bash
# All benchmarks: every contestant on mlp, llama_tp and llama_dp_tp (see benchmarks/README.md).
#   bash benchmarks/run.sh                          # 30 timed steps per contestant
#   bash benchmarks/run.sh --steps 5 --warmup 2     # quick check
#   bash benchmarks/run.sh --workloads llama_tp --profile ours
source "$(dirname "$0")/../scripts/env.sh"
python -c "import matplotlib" 2>/dev/null || pip install -q --disable-pip-version-check -e "$ROOT[bench]"
exec python -m benchmarks.run "$@"
