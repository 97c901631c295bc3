"""OpInfo conformance harness (issue 4): ``python -m dynamo_dist.conformance --help``."""
