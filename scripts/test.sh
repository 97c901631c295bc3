#!/usr/bin/env bash
# The test suite (single-process tests plus a few real 2-rank gloo runs).
source "$(dirname "$0")/env.sh"
exec python -m pytest -q tests "$@"
