"""Bagua's load-balancing samplers: each rank's ``i``-th sample of similar cost.

Where samples differ in cost (sentence lengths in NLP and speech), ranks given samples of
different cost wait for the slowest at every step. :class:`LoadBalancingDistributedSampler`
sorts the samples by ``complexity_fn`` and gives the ranks neighbours in that order::

    order  = samples sorted by complexity (+ noise, below), ties by index
    chunks = order cut into num_samples chunks of num_replicas consecutive samples
             (the last filled from the start of the order)
    rank r, its i-th sample = the r-th sample of the i-th chunk, chunks in shuffled order

With ``shuffle``, each epoch draws, from a generator seeded with ``seed + epoch``, an integer
in ``[0, int((max - min) * random_level) + 1)`` added to each sample's complexity before the
sort, and then the order of the chunks: ``random_level=0`` balances best, ``1`` shuffles across
the whole range of complexities. The draws are Bagua's, so a run gets the samples it got with
Bagua. As with ``torch.utils.data.DistributedSampler``, each rank has ``ceil(n / num_replicas)``
samples (``drop_last=False``: some samples repeat) or ``ceil((n - num_replicas) / num_replicas)``
(``drop_last=True``), and ``set_epoch`` must be called before each epoch.

:class:`LoadBalancingDistributedBatchSampler` cuts each rank's samples into batches with a
function of the indices (batches of similar total cost, for variable-size batches) and gives
every rank as many batches.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Optional, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Sampler

__all__ = ["LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler"]


class LoadBalancingDistributedSampler(Sampler[int]):
    """The samples of one rank, each of a cost similar to the other ranks' at the same position
    (module docstring).

    Args:
        dataset: the dataset (of constant length); ``complexity_fn`` reads each of its samples
            once, here.
        complexity_fn: a sample's cost, a number (or a one-element tensor).
        num_replicas: the number of ranks; the default process group's size by default.
        rank: this rank, in ``[0, num_replicas)``; the default process group's by default.
        shuffle: shuffle the chunks (and add the noise) every epoch.
        seed: the shuffle's seed; the same on every rank.
        drop_last: drop the tail so that no sample repeats, rather than repeat samples so that
            every rank has as many.
        random_level: in ``[0, 1]``: how far apart in cost a rank's samples may be from the
            other ranks' (0: neighbours in cost).

    Example::

        sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=lambda sample: len(sample[0]))
        loader = torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=32)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for batch in loader: ...
    """

    def __init__(
        self,
        dataset: Dataset,
        complexity_fn: Callable[..., Any],
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        random_level: float = 0,
    ) -> None:
        num_replicas, rank = _replicas_and_rank(num_replicas, rank)
        if not callable(complexity_fn):
            raise TypeError(f"complexity_fn must be a function of a sample, got {type(complexity_fn).__name__}")
        if not 0.0 <= random_level <= 1.0:
            raise ValueError(f"Invalid random level {random_level}, should be in the range [0.0, 1.0]")
        length = len(dataset) if isinstance(dataset, Sized) else 0
        if length == 0:
            raise ValueError("the dataset is empty (or has no len()); the sampler needs its samples' complexities")
        self.dataset = dataset
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        if drop_last and length % num_replicas != 0:
            self.num_samples = math.ceil((length - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(length / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.item_complexity_map = {i: _number(complexity_fn(dataset[i])) for i in range(length)}
        costs = self.item_complexity_map.values()
        self.random_number = int((max(costs) - min(costs)) * random_level + 1)

    def shuffle_chunks(self) -> tuple[list[list[int]], list[int]]:
        """This epoch's chunks (``num_replicas`` sample indices each, by cost) and the order in
        which the ranks take them (``num_samples`` chunk indices)."""
        costs = self.item_complexity_map
        if self.shuffle:
            # on the CPU whatever torch's default device is: the same draws on every rank and machine
            generator = torch.Generator(device="cpu")
            generator.manual_seed(self.seed + self.epoch)
            noise = torch.randint(self.random_number, (len(costs),), generator=generator, device="cpu").tolist()
            costs = {i: cost + extra for (i, cost), extra in zip(costs.items(), noise)}
        order = sorted(costs, key=costs.__getitem__)  # stable: ties by index
        count = max(1, self.num_samples)
        chunks = [
            [order[(c * self.num_replicas + k) % len(order)] for k in range(self.num_replicas)] for c in range(count)
        ]
        if self.shuffle:
            taken = torch.randperm(count, generator=generator, device="cpu").tolist()
        else:
            taken = list(range(count))
        return chunks, taken[: self.num_samples]

    def __iter__(self) -> Iterator[int]:
        chunks, taken = self.shuffle_chunks()
        return iter([chunks[c][self.rank] for c in taken])

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which seeds the shuffle (with ``seed``): call it before each epoch,
        with the same value on every rank.

        Args:
            epoch: the epoch number.
        """
        self.epoch = epoch


class LoadBalancingDistributedBatchSampler(Sampler[list[int]]):
    """This rank's batches: its samples from a :class:`LoadBalancingDistributedSampler`, cut by
    ``batch_fn``; every rank gets as many batches (the longest rank's number, the others
    repeating their first batches; with ``drop_last``, the shortest's, the others dropping
    their last ones).

    Args:
        sampler: the load-balancing sampler (with ``drop_last=False``).
        batch_fn: ``batch_fn(indices) -> batches``: a rank's sample indices, in order, cut into
            lists of indices (a generator of them is fine).
        drop_last: drop the batches beyond the shortest rank's number, rather than repeat batches.

    Example::

        def batch_fn(indices):  # batches of at most 4096 tokens
            batch, tokens = [], 0
            for i in indices:
                if batch and tokens + lengths[i] > 4096:
                    yield batch
                    batch, tokens = [], 0
                batch.append(i)
                tokens += lengths[i]
            if batch:
                yield batch

        batches = LoadBalancingDistributedBatchSampler(sampler, batch_fn)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches)
    """

    def __init__(
        self,
        sampler: LoadBalancingDistributedSampler,
        batch_fn: Callable[[list[int]], Iterable[list[int]]],
        drop_last: bool = False,
    ) -> None:
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise ValueError("sampler should be of LoadBalancingDistributedSampler type.")
        if sampler.drop_last:
            raise ValueError("drop_last of sampler should be False")
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.drop_last = drop_last
        self.num_replicas = sampler.num_replicas
        self.rank = sampler.rank
        self.generate_batches()

    def generate_batches(self) -> None:
        """Cut every rank's samples of the sampler's epoch into batches, and even their numbers."""
        chunks, taken = self.sampler.shuffle_chunks()
        batches = [self._batches_of([chunks[c][rank] for c in taken]) for rank in range(self.num_replicas)]
        counts = [len(b) for b in batches]
        if min(counts) == 0:
            raise ValueError(f"batch_fn gave no batches for rank {counts.index(0)}'s {len(taken)} samples")
        self.total_batch = min(counts) if self.drop_last else max(counts)
        self.padded_batches = [
            [b[i % len(b)] for i in range(self.total_batch)] for b in batches
        ]  # the first batches again, or the last ones dropped

    def _batches_of(self, indices: list[int]) -> list[list[int]]:
        batches = []
        for batch in self.batch_fn(indices):
            if not isinstance(batch, Iterable) or isinstance(batch, (str, bytes)):
                raise TypeError(
                    f"batch_fn must give lists of sample indices, got a batch of type {type(batch).__name__}"
                )
            batches.append(list(batch))
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.padded_batches[self.rank])

    def __len__(self) -> int:
        return self.total_batch

    def set_epoch(self, epoch: int) -> None:
        """Set the sampler's epoch and cut the new epoch's batches.

        Args:
            epoch: the epoch number, the same on every rank.
        """
        self.sampler.set_epoch(epoch)
        self.generate_batches()


def _replicas_and_rank(num_replicas: Optional[int], rank: Optional[int]) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "num_replicas and rank default to the default process group's, which is not initialised; "
                "call torch.distributed.init_process_group first, or pass num_replicas and rank"
            )
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        rank = dist.get_rank() if rank is None else rank
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
    return num_replicas, rank


def _number(cost: Any) -> Any:
    """A complexity as a Python number (a one-element tensor's value)."""
    if isinstance(cost, torch.Tensor):
        if cost.numel() != 1:
            raise ValueError(f"complexity_fn must give a number per sample, got a tensor of shape {tuple(cost.shape)}")
        return cost.item()
    if not isinstance(cost, numbers.Real) or isinstance(cost, bool):
        raise TypeError(f"complexity_fn must give a number per sample, got {type(cost).__name__}")
    return cost
