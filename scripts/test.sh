#!/usr/bin/env bash
# The test suite (single-process tests plus a few real 2- and 4-rank gloo runs), spread over one
# pytest worker per core (pytest-xdist; at most 4: each worker compiles with Inductor and launches
# gloo ranks of its own). DYNAMO_DIST_TEST_WORKERS=0 runs it in this process, in file order.
# DYNAMO_DIST_FULL_TESTS=1: the full tier (tests/conftest.py), not only CI's default one.
# --dist loadgroup: a property sweep and the summary test that reads its counts share a worker.
source "$(dirname "$0")/env.sh"
exec python -m pytest -q -n "${DYNAMO_DIST_TEST_WORKERS:-auto}" --maxprocesses=4 \
  --dist loadgroup tests "$@"
