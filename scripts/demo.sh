#!/usr/bin/env bash
# The main job: train a small Llama with backend="dist" (tp=2 by default; pass --mesh dp=2,tp=2).
source "$(dirname "$0")/env.sh"
exec python -m dynamo_dist.testing.demo "$@"
