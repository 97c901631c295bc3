"""The model zoo: real architectures (transformers configs with random weights, plus ConvNets)
trained a few AdamW steps under the stock planners on simulated and on real gloo ranks, each
compared with one process. ``python -m dynamo_dist.testing.zoo --help``."""
