"""The reference must not depend on how the work is split: ubatch size, sequences together or apart,
prefill or token-by-token decode, offload count (when both back-ends compute the same thing)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mamba_debug.backends import Backend, reference_backend
from mamba_debug.model import Runner
from mamba_debug.ops import OpTable, TORCH_OPS
from mamba_debug.placement import Placement

from conftest import random_model

P = 13


def _prompts(model, S=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (S, P), generator=g)


@pytest.mark.parametrize("d_conv", [3, 4])
def test_ubatch_size_does_not_change_logits(d_conv):
    model = random_model(d_conv=d_conv)
    tokens = _prompts(model)
    whole = model.logits(tokens)
    for ub in sorted({1, 2, 3, d_conv - 1, d_conv, 7, P}):
        torch.testing.assert_close(model.logits(tokens, ubatch=ub), whole, rtol=0, atol=1e-12, msg=f"ubatch {ub}")


def test_sequences_together_equal_one_by_one():
    model = random_model(seed=3)
    tokens = _prompts(model, S=3)
    assert len({tuple(t.tolist()) for t in tokens}) == 3            # different prompts per sequence
    together = model.logits(tokens, ubatch=4)
    for s in range(3):
        alone = model.logits(tokens[s:s + 1], ubatch=4)
        torch.testing.assert_close(together[s:s + 1], alone, rtol=0, atol=1e-12)


def test_sequence_k_does_not_depend_on_sequence_j():
    model = random_model(seed=4)
    tokens = _prompts(model, S=2)
    other = tokens.clone()
    other[1] = (other[1] + 5) % model.config.vocab_size
    torch.testing.assert_close(model.logits(tokens, ubatch=5)[0], model.logits(other, ubatch=5)[0], rtol=0, atol=0)


def test_prefill_equals_token_by_token_decode():
    model = random_model(seed=5)
    tokens = _prompts(model, S=2)
    whole = model.logits(tokens)
    runner = Runner(model, reference_backend())
    first = runner.prefill(tokens[:, :4], ubatch=4)
    steps = [runner.forward(tokens[:, t:t + 1]) for t in range(4, P)]
    torch.testing.assert_close(torch.cat([first] + steps, dim=1), whole, rtol=0, atol=1e-12)


def _same_math_device():
    """A 'device' back-end that computes exactly what the reference does (float64 torch ops)."""
    return Backend("device:same", OpTable("same", TORCH_OPS), torch.float64, torch.device("cpu"), "same math")


@pytest.mark.parametrize("rule", ["llama2024", "llama2025"])
def test_every_offload_count_gives_the_same_logits(rule):
    model = random_model(seed=6, n_layer=3)
    tokens = _prompts(model, S=2)
    whole = model.logits(tokens)
    for offload in range(0, model.config.n_layer + 3):
        runner = Runner(model, reference_backend(), _same_math_device(), Placement(3, offload, rule))
        torch.testing.assert_close(runner.prefill(tokens, 3), whole, rtol=0, atol=1e-12, msg=f"offload {offload}")


def test_offload_moves_layers_to_the_device_backend():
    model = random_model(seed=6, n_layer=3)
    seen = []
    dev = _same_math_device()
    class Seen:
        def site(self, layer, site, v, per_token):
            seen.append((layer, site))

    runner = Runner(model, reference_backend(), dev, Placement(3, 2), observer=Seen())
    assert [b.name for b in runner.layer_backends] == ["reference", "device:same", "device:same"]
    assert runner.head_backend.name == "reference"
    runner.prefill(_prompts(model, S=1), 5)
    assert (2, "gate") in seen and (None, "logits") in seen


FIRST_CALL = """
import mamba_debug, torch
torch.set_num_threads(2)
torch.manual_seed(0)
x = torch.randn(4096, dtype=torch.float64)
a, la = torch.exp(x), torch.log(x.abs() + 0.5)
b, lb = torch.exp(x), torch.log(x.abs() + 0.5)
print(int((a != b).sum()) + int((la != lb).sum()))
"""


def test_a_process_first_exp_gives_the_bits_of_every_later_one():
    """The same model gives the same bits in every process (ops._settle_vector_math): without it, in about half the
    processes on an AVX-512/AMX CPU, the first exp or log split over two threads took another vector routine for
    the second thread's half (A = -exp(A_log) at load then differed by 1 ulp). Six fresh processes, two threads."""
    for _ in range(6):
        out = subprocess.run([sys.executable, "-c", FIRST_CALL], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split()[-1] == "0", f"the first exp/log of a process differed from the next: {out.stdout}"
