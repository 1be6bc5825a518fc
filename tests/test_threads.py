"""Fused and unfused updates in two threads at once do not see each other's flat layout."""

from __future__ import annotations

import threading

import torch
from devices import DEVICE, seeded

import functional_bagua as fb

STEPS = 200


def lamb_run(fused: bool, out: dict, key: str, barrier: threading.Barrier) -> None:
    with torch.device(DEVICE):  # the default device is per thread: a new thread starts on the CPU
        _lamb_run(fused, out, key, barrier)


def _lamb_run(fused: bool, out: dict, key: str, barrier: threading.Barrier) -> None:
    gen = seeded(0)
    params = {f"w{i}": torch.randn(6, 5, generator=gen, dtype=torch.float64) for i in range(8)}
    grads = [{k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in params.items()} for _ in range(4)]
    tx = fb.lamb(1e-2, weight_decay=0.1)
    layout = fb.FlatLayout.of(params)
    if fused:
        tx, params, grads = fb.fuse(tx, layout), layout.flatten(params), [layout.flatten(g) for g in grads]
    state = tx.init(params)
    barrier.wait()
    try:
        for step in range(STEPS):
            updates, state = tx.update(grads[step % 4], state, params)
            params = fb.apply_updates(params, updates)
        out[key] = layout.unflatten(params) if fused else params
    except Exception as e:  # reported to the test
        out[key] = e


def test_a_fused_update_in_one_thread_leaves_an_unfused_one_in_another_alone():
    """The active layout was a list shared by all threads: an unfused LAMB in one thread read the
    fused one's layout and failed with a KeyError on its own leaf name."""
    out: dict = {}
    barrier = threading.Barrier(2)
    threads = [
        threading.Thread(target=lamb_run, args=(fused, out, name, barrier))
        for fused, name in ((True, "fused"), (False, "tree"))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    alone: dict = {}
    for fused, name in ((True, "fused"), (False, "tree")):
        lamb_run(fused, alone, name, threading.Barrier(1))
    for name in ("fused", "tree"):
        assert not isinstance(out[name], Exception), f"{name}: {out[name]!r}"
        for k in alone["tree"]:
            torch.testing.assert_close(out[name][k], alone["tree"][k], rtol=1e-12, atol=1e-14)
            assert torch.equal(out[name][k], alone[name][k])  # each thread's result is its single-thread result
