"""OpInfo conformance harness (issue 4): ``python -m dynamo_dist.testing.conformance --help``."""
