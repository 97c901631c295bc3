"""One model-zoo cell on real gloo ranks: ``dynamo_dist.testing.zoo.worker``'s command line
(MODEL MESH OUT.json [--steps S] [--no-inductor]); rank 0 writes the cell's row to OUT.json."""

import runpy
import sys

if __name__ == "__main__":
    sys.argv[0] = "dynamo_dist.testing.zoo.worker"
    runpy.run_module("dynamo_dist.testing.zoo.worker", run_name="__main__")
