"""Real multi-process runs (gloo, 2 ranks): loss, gradient and parameter parity with one process."""

import re

import pytest

from conftest import torchrun


@pytest.mark.parametrize("model,inductor", [("mlp", "1"), ("llama", "0")])
def test_two_rank_tp_parity(model, inductor):
    out = torchrun("train_parity.py", 2, "--model", model, "--mesh", "tp=2",
                   "--inductor", inductor).stdout
    m = re.search(r"max relative loss difference ([0-9.e+-]+)", out)
    assert m and float(m.group(1)) <= 1e-4, out


def test_every_redistribute_on_a_2x2_mesh():
    out = torchrun("redistribute_all.py", 4).stdout
    m = re.search(r"REDISTRIBUTE OK (\d+) pairs", out)
    assert m and int(m.group(1)) >= 60, out


def test_four_rank_dp_tp_parity():
    out = torchrun("train_parity.py", 4, "--model", "llama", "--mesh", "dp=2,tp=2",
                   "--inductor", "0").stdout
    m = re.search(r"max relative loss difference ([0-9.e+-]+)", out)
    assert m and float(m.group(1)) <= 1e-4, out
