"""Bagua's load-balancing samplers (``bagua.torch_api.contrib``): the samples each rank gets,
against the rule written out here, torch's DistributedSampler's lengths, and Bagua's own tests'
expectations (one rank, unshuffled: the samples in order of cost; batches of growing size)."""

from __future__ import annotations

import math

import pytest
import torch
from devices import seeded
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from functional_bagua.compat.contrib import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler


def dataset_of(costs):
    return TensorDataset(torch.randn(len(costs), 2), torch.tensor(costs))


def by_cost(sample):
    return sample[1]


def samplers(costs, replicas, **kwargs):
    data = dataset_of(costs)
    return [LoadBalancingDistributedSampler(data, by_cost, replicas, r, **kwargs) for r in range(replicas)]


def test_one_rank_unshuffled_gives_the_samples_in_order_of_cost():
    """Bagua's own test: costs a permutation of 0..n-1, so the i-th sample loaded costs i."""
    n = 10
    data = TensorDataset(torch.randn(n, 2), torch.randperm(n, generator=seeded(0)))
    sampler = LoadBalancingDistributedSampler(data, by_cost, num_replicas=1, rank=0, shuffle=False)
    assert [batch[1].item() for batch in DataLoader(data, batch_size=1, sampler=sampler)] == list(range(n))


def test_unshuffled_ranks_take_neighbours_in_cost_as_written_out():
    """The rule: sort by cost (ties by index), cut into chunks of num_replicas, rank r takes the
    r-th of each chunk; the last chunk wraps to the start."""
    costs = [5, 3, 9, 1, 3, 7, 2, 8, 6, 4, 0]
    replicas = 3
    order = sorted(range(len(costs)), key=lambda i: costs[i])
    chunks = math.ceil(len(costs) / replicas)
    expected = [[order[(c * replicas + r) % len(order)] for c in range(chunks)] for r in range(replicas)]
    assert [list(s) for s in samplers(costs, replicas, shuffle=False)] == expected


@pytest.mark.parametrize("random_level", [0.0, 0.3, 1.0])
def test_shuffled_ranks_split_the_data_and_each_position_is_balanced(random_level):
    costs = torch.randint(0, 1000, (120,), generator=seeded(1)).tolist()
    replicas = 4
    for epoch in range(3):
        ranks = samplers(costs, replicas, shuffle=True, seed=7, random_level=random_level)
        for s in ranks:
            s.set_epoch(epoch)
        got = [list(s) for s in ranks]
        assert sorted(i for rank in got for i in rank) == list(range(len(costs)))  # 120 / 4: no repeats
        spread = max(max(costs[rank[i]] for rank in got) - min(costs[rank[i]] for rank in got) for i in range(30))
        noise = int((max(costs) - min(costs)) * random_level + 1)
        # neighbours in the noisy order differ by at most the noise's range beyond the costs' own gap
        sorted_costs = sorted(costs)
        widest_gap = max(sorted_costs[i + replicas - 1] - sorted_costs[i] for i in range(len(costs) - replicas + 1))
        assert spread <= widest_gap + noise
        if random_level == 0.0:
            assert spread <= widest_gap


def test_the_shuffle_draws_on_the_cpu_whatever_torchs_default_device():
    """Its generator is a CPU one: under another default device (CUDA; here "meta", which no
    generator can draw on) the ranks still get the CPU's order, as every rank must agree."""
    costs = list(range(30))
    ranks = samplers(costs, 2, seed=3, random_level=0.5)
    expected = [list(s) for s in ranks]
    with torch.device("meta"):
        got = [list(s) for s in ranks]
    assert got == expected


def test_the_shuffle_follows_seed_and_epoch_and_is_the_same_on_every_rank():
    costs = list(range(50))

    def orders(seed, epoch):
        ranks = samplers(costs, 2, seed=seed, random_level=0.5)
        for s in ranks:
            s.set_epoch(epoch)
        return [list(s) for s in ranks]

    assert orders(0, 0) == orders(0, 0)
    assert orders(0, 0) != orders(0, 1) and orders(0, 0) != orders(1, 0)
    first = orders(0, 0)
    assert sorted(first[0] + first[1]) == costs  # the same chunks and order on both ranks: a partition


@pytest.mark.parametrize("n, replicas", [(10, 3), (12, 4), (2, 3), (7, 7), (1, 2)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_lengths_are_torchs_distributed_samplers(n, replicas, drop_last):
    costs = list(range(n))
    ours = samplers(costs, replicas, drop_last=drop_last)
    theirs = [DistributedSampler(range(n), replicas, r, drop_last=drop_last) for r in range(replicas)]
    assert [len(s) for s in ours] == [len(t) for t in theirs]
    with torch.device("cpu"):  # torch's sampler draws with a CPU generator on the default device
        theirs_drawn = [list(t) for t in theirs]
    assert [len(list(s)) for s in ours] == [len(t) for t in theirs_drawn]
    if drop_last:
        taken = [i for s in ours for i in s]
        assert len(taken) == len(set(taken))  # nothing repeats


def test_batches_of_growing_size_as_in_bagua_own_test():
    """One rank, unshuffled, batch_fn cutting 1, 2, 3, ... samples: batch i has i + 1 samples and
    starts at the sample of cost 1 + 2 + ... + i."""
    total_batch = 5
    n = sum(range(1, total_batch + 1))
    data = TensorDataset(torch.randn(n, 2), torch.randperm(n, generator=seeded(2)))

    def growing(indices):
        batch, size = [], 1
        for i in indices:
            batch.append(i)
            if len(batch) == size:
                yield batch
                batch, size = [], size + 1
        if batch:
            yield batch

    sampler = LoadBalancingDistributedSampler(data, by_cost, num_replicas=1, rank=0, shuffle=False)
    loader = DataLoader(data, batch_sampler=LoadBalancingDistributedBatchSampler(sampler, growing))
    start = 0
    for i, (x, cost) in enumerate(loader):
        assert x.shape[0] == i + 1 and cost[0].item() == start
        start += i + 1
    assert i == total_batch - 1


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_rank_gets_as_many_batches(drop_last):
    """Rank 0's 10 samples cut into 3 batches, rank 1's into 5: both get 5 (rank 0 repeating its
    first ones) or 3 (rank 1 dropping its last ones)."""
    costs = list(range(20))
    ranks = samplers(costs, 2, shuffle=False)

    def cut(indices):  # rank 0's first sample is cost 0: 3 batches; rank 1's: 5
        size = 4 if indices[0] == 0 else 2
        return [indices[i : i + size] for i in range(0, len(indices), size)]

    got = [list(LoadBalancingDistributedBatchSampler(s, cut, drop_last=drop_last)) for s in ranks]
    mine = [cut(list(s)) for s in ranks]
    count = 3 if drop_last else 5
    assert [len(b) for b in got] == [count, count]
    for batches, own in zip(got, mine):
        assert batches == [own[i % len(own)] for i in range(count)]


def test_set_epoch_cuts_the_new_epochs_batches():
    ranks = samplers(list(range(40)), 2, seed=3, random_level=1.0)
    batches = LoadBalancingDistributedBatchSampler(ranks[0], lambda ix: [ix[i : i + 4] for i in range(0, len(ix), 4)])
    first = list(batches)
    batches.set_epoch(1)
    ranks[1].set_epoch(1)
    assert list(batches) != first
    assert [i for b in batches for i in b] == list(ranks[0])


@pytest.mark.parametrize(
    "make, error, says",
    [
        (lambda d: LoadBalancingDistributedSampler(d, by_cost, 2, 2), ValueError, r"Invalid rank 2.*\[0, 1\]"),
        (lambda d: LoadBalancingDistributedSampler(d, by_cost, 2, 0, random_level=2), ValueError, "random level"),
        (lambda d: LoadBalancingDistributedSampler(d, 5, 2, 0), TypeError, "complexity_fn must be a function"),
        (lambda d: LoadBalancingDistributedSampler(d, lambda s: s[0], 2, 0), ValueError, r"shape \(2,\)"),
        (lambda d: LoadBalancingDistributedSampler(d, lambda s: "x", 2, 0), TypeError, "got str"),
        (lambda d: LoadBalancingDistributedSampler(d, by_cost), RuntimeError, "init_process_group"),
        (lambda d: LoadBalancingDistributedSampler(dataset_of([]), by_cost, 1, 0), ValueError, "empty"),
        (
            lambda d: LoadBalancingDistributedBatchSampler(
                LoadBalancingDistributedSampler(d, by_cost, 1, 0, drop_last=True), lambda ix: [ix]
            ),
            ValueError,
            "drop_last of sampler",
        ),
        (
            lambda d: LoadBalancingDistributedBatchSampler(LoadBalancingDistributedSampler(d, by_cost, 1, 0), list),
            TypeError,
            "lists of sample indices, got a batch of type int",
        ),
        (
            lambda d: LoadBalancingDistributedBatchSampler(
                LoadBalancingDistributedSampler(d, by_cost, 1, 0), lambda ix: []
            ),
            ValueError,
            "no batches for rank 0",
        ),
    ],
)
def test_bad_input_is_named(make, error, says):
    with pytest.raises(error, match=says):
        make(dataset_of([3, 1, 2]))
