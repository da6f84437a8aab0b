"""Greedy rows on a CPU: the C kernel picks torch.argmax's token and gives log_softmax's log-probability."""

import pytest
import torch

from gaudi_runtime.device import cpu_sampling
from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.shard import sampling
from gaudi_runtime.shard.sampling import BatchSampler


@pytest.fixture(scope="module")
def kernel():
    k = cpu_sampling.kernel()
    assert k is not None, "the greedy kernel did not build here: is there a C compiler (cc or $CC)?"
    return k


def scores(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 4
    x[0, vocab // 3] = x[0, vocab - 1] = 50.0  # a tie: the first index wins
    x[-1, : vocab // 2] = float("-inf")  # a grammar's mask
    return x


@pytest.mark.parametrize("rows,vocab", [(1, 16), (3, 17), (48, 8000), (5, 32003), (2, 128256)])
def test_ids_are_argmaxs_and_logprobs_log_softmaxs(kernel, rows, vocab):
    x = scores(rows, vocab)
    ids, logprobs = kernel(x)
    assert torch.equal(ids, torch.argmax(x, dim=-1))
    # Against the exact value (float64): no further off than torch's own float32 log_softmax (which is
    # 4.6e-6 off at 32,003 tokens here), nor than 1e-6 where that is closer.
    exact = torch.log_softmax(x.double(), dim=-1).gather(1, ids[:, None])[:, 0]
    torchs = torch.log_softmax(x, dim=-1).gather(1, ids[:, None])[:, 0]
    bound = max((torchs.double() - exact).abs().max().item(), 1e-6)
    assert (logprobs.double() - exact).abs().max().item() <= bound


def test_rows_of_a_wider_tensor_are_read_in_place(kernel):
    wide = scores(6, 100)
    ids, _ = kernel(wide[:, :64])
    assert torch.equal(ids, torch.argmax(wide[:, :64], dim=-1))


def test_the_answer_does_not_depend_on_the_thread_count(kernel):
    x = scores(48, 8000, seed=3)
    most = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x)
    finally:
        torch.set_num_threads(most)
    every = kernel(x)
    assert torch.equal(one[0], every[0]) and torch.equal(one[1], every[1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_rows_it_cannot_answer_are_left_to_torch(kernel, bad):
    x = scores(4, 100)
    x[2, 7] = bad
    assert kernel(x) is None
    assert kernel(torch.full((2, 100), float("-inf"))) is None
    assert kernel(x.double()) is None and kernel(x[:, :8]) is None


def test_a_greedy_batch_takes_the_kernel_and_gives_torchs_tokens(kernel, monkeypatch):
    params = [SamplingParameters(), SamplingParameters(repetition_penalty=1.3)]
    logits = scores(2, 300)
    calls = []
    real = cpu_sampling.GreedyKernel.__call__
    monkeypatch.setattr(cpu_sampling.GreedyKernel, "__call__", lambda self, x: calls.append(x.shape) or real(self, x))
    fast = BatchSampler(params, [0, 0], [[1, 2], [5]], 300, torch.device("cpu"))(logits)
    assert calls == [(2, 300)]
    monkeypatch.setattr(sampling, "cpu_greedy", lambda x: None)
    slow = BatchSampler(params, [0, 0], [[1, 2], [5]], 300, torch.device("cpu"))(logits)
    assert torch.equal(fast.next_ids, slow.next_ids)
    torch.testing.assert_close(fast.logprobs, slow.logprobs, rtol=0, atol=1e-6)


def test_top_n_and_sampled_rows_stay_on_torch(kernel, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_sampling.GreedyKernel, "__call__", lambda self, x: calls.append(x.shape))
    logits = scores(2, 300)
    BatchSampler([SamplingParameters()] * 2, [2, 0], [[1], [2]], 300, torch.device("cpu"))(logits)
    BatchSampler([SamplingParameters(), SamplingParameters(do_sample=True, seed=1)], [0, 0], [[1], [2]], 300,
                 torch.device("cpu"))(logits)
    assert calls == []
