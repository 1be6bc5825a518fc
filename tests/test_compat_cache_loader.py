"""Bagua's cache loader and cached dataset (``bagua.torch_api.contrib``): each value made once,
read back equal (pickled), buffered writes visible before they are written, keys counted once
per name, and Bagua's "redis" backend served by a named substitute (two ranks sharing torch's
store: test_compat_bagua.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from functional_bagua.compat.contrib import CachedDataset, CacheLoader


def counting(calls):
    def load(key):
        calls.append(key)
        return {"key": key, "tensor": torch.arange(3) * key}

    return load


def test_each_value_is_made_once_and_read_back_equal():
    calls: list = []
    loader = CacheLoader(backend="memory", dataset_name="d", writer_buffer_size=3)
    first = [loader.get(k, counting(calls)) for k in (1, 2, 1, 5, 2)]
    again = [loader.get(k, counting(calls)) for k in (1, 2, 5)]
    assert calls == [1, 2, 5]  # the second 1 was read from the write buffer, before any write
    assert torch.equal(again[2]["tensor"], torch.arange(3) * 5) and first[0]["key"] == 1
    assert loader.num_keys() == 3  # the third new value filled the buffer: written
    loader.get(9, counting(calls))
    assert loader.num_keys() == 3
    loader.flush()
    assert loader.num_keys() == 4


def test_loaders_sharing_a_store_share_values_and_count_each_key_once():
    store = dist.HashStore()
    a = CacheLoader(backend="store", dataset_name="shared", store=store)
    b = CacheLoader(backend="store", dataset_name="shared", store=store)
    other = CacheLoader(backend="store", dataset_name="other", store=store)
    calls: list = []
    a.get(4, counting(calls))
    assert b.get(4, counting(calls))["key"] == 4 and calls == [4]
    other.get(4, counting(calls))  # another name: another key
    assert calls == [4, 4] and (a.num_keys(), other.num_keys()) == (1, 1)
    c = CacheLoader(backend="store", dataset_name="shared", store=store, writer_buffer_size=2)
    d = CacheLoader(backend="store", dataset_name="shared", store=store, writer_buffer_size=2)
    for loader in (c, d):  # both make key 7 before either writes it
        loader.get(7, counting(calls))
    c.flush()
    d.flush()
    assert a.num_keys() == 2


def test_a_cached_dataset_makes_each_sample_once_across_epochs():
    made: list = []

    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 5

        def __getitem__(self, i):
            made.append(i)
            return torch.tensor([float(i)]), i % 2

    dataset = CachedDataset(Slow(), backend="memory", dataset_name="slow", writer_buffer_size=2)
    epochs = [[(x.clone(), y.clone()) for x, y in torch.utils.data.DataLoader(dataset, batch_size=2)] for _ in range(2)]
    assert sorted(made) == list(range(5)) and len(dataset) == 5
    for (x0, y0), (x1, y1) in zip(*epochs):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)


def test_bagua_redis_default_is_served_by_a_named_substitute():
    with pytest.warns(UserWarning, match="no redis servers here; the cache is in this process's memory"):
        loader = CacheLoader(dataset_name="r", hosts=None, cluster_mode=True)
    assert loader.get("k", lambda k: k * 2) == "kk"


@pytest.mark.parametrize(
    "make, error, says",
    [
        (lambda: CacheLoader(backend="lmdb"), ValueError, "Invalid backend 'lmdb'"),
        (lambda: CacheLoader(backend="memory", writer_buffer_size=0), ValueError, "at least 1"),
        (lambda: CacheLoader(backend="store"), RuntimeError, "not initialized"),
    ],
)
def test_bad_input_is_named(make, error, says):
    if dist.is_available() and dist.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")
    with pytest.raises(error, match=says):
        make()


def test_dataloader_workers_share_the_store_through_their_own_connections():
    """A TCPStore made here; two forked DataLoader workers fill the cache; this process reads it."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    made: list = []

    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            made.append(i)  # in a worker: this process's list stays empty
            return torch.tensor([float(i)])

    class Reporting(CachedDataset):
        """Each sample with whether the worker that served it talks to the store through a
        connection of its own (made in that process), not the parent's copy."""

        def __getitem__(self, item):
            sample = super().__getitem__(item)
            loader = self.cache_loader
            return sample, loader._pid == os.getpid() and loader.store is not parents_store

    dataset = Reporting(Slow(), backend="store", dataset_name="workers", writer_buffer_size=1, store=store)
    parents_store = dataset.cache_loader.store
    # workers make CPU tensors whatever the test device (a forked process cannot start CUDA)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=2, num_workers=2, timeout=60, worker_init_fn=lambda _: torch.set_default_device("cpu")
    )
    batches = list(loader)
    assert torch.cat([x for x, _ in batches]).flatten().tolist() == [float(i) for i in range(8)]
    assert all(bool(own.all()) for _, own in batches)
    assert dataset.cache_loader.num_keys() == 8 and made == []
    assert [dataset[i][0].item() for i in range(8)] == [float(i) for i in range(8)] and made == []  # read back here


def test_numpy_complexities_and_numbers_are_numbers():
    from functional_bagua.compat.contrib import LoadBalancingDistributedSampler

    np = pytest.importorskip("numpy", reason="numpy numbers")
    data = torch.utils.data.TensorDataset(torch.arange(4.0))
    sampler = LoadBalancingDistributedSampler(data, lambda s: np.int64(-s[0].item()), 1, 0, shuffle=False)
    assert list(sampler) == [3, 2, 1, 0]
