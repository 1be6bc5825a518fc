"""Shared by the tests of the compiled and fused second-order transforms (SOAP, Shampoo,
PSGD-Kron): draws of parameters and gradients, a pure update run over several steps, a
checkpoint round trip of a fused state, and the layout that ``distributed.shard`` makes active."""

from __future__ import annotations

import io
from typing import Callable

import torch
from devices import seeded

import functional_bagua as fb


def draws(shapes: dict, steps: int, dtype=torch.float64, seed: int = 0) -> tuple[dict, list]:  # noqa: ANN001
    gen = seeded(seed)
    params = {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()} for _ in range(steps)]
    return params, grads


def trace(update, state, params: dict, grads: list) -> list:  # noqa: ANN001
    """The parameters after each step of ``update`` (a pure ``tx.update``)."""
    out = []
    for g in grads:
        u, state = update(g, state, params)
        params = fb.apply_updates(params, u)
        out.append(params)
    return out


def resumed_and_uninterrupted(
    tx: fb.GradientTransformation, layout: fb.FlatLayout, params: dict, grads: list, seed: Callable = lambda t: None
) -> tuple[dict, dict]:
    """The flat parameters after all ``grads`` with the fused ``tx``: run through, and saved
    (``fb.state_dict``, ``torch.save``) after half of them and resumed from the file.
    ``seed(t)`` runs before each of the later steps, on both runs."""
    flat = layout.flatten(params)
    state, p = tx.init(flat), flat
    half = len(grads) // 2
    for g in grads[:half]:
        u, state = tx.update(layout.flatten(g), state, p)
        p = fb.apply_updates(p, u)
    buffer = io.BytesIO()
    torch.save({"params": p, "state": fb.state_dict(state)}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    p_loaded, state_loaded = saved["params"], fb.load_state_dict(tx.init(flat), saved["state"])
    for t, g in enumerate(grads[half:]):
        seed(t)
        u, state = tx.update(layout.flatten(g), state, p)
        p = fb.apply_updates(p, u)
        seed(t)
        u, state_loaded = tx.update(layout.flatten(g), state_loaded, p_loaded)
        p_loaded = fb.apply_updates(p_loaded, u)
    return p, p_loaded


class ShardLike:
    """What ``distributed.shard`` makes active: segments that raise, no shape groups."""

    is_shard = True

    def segments(self, key: str) -> tuple:
        raise NotImplementedError


def compiled_fused_and_eager_steps(model, tx, batch, steps: int = 6):  # noqa: ANN001, ANN201
    """``make_train_step`` compiled over flat buffers and eager over the tree, from the same
    model and batch: per step, ``(t, loss, eager_loss, params from the buffers, eager params)``."""
    params = {k: v.detach().clone() for k, v in fb.params_of(model).items()}
    layout = fb.FlatLayout.of(params)
    compiled = fb.make_train_step(model, torch.nn.functional.mse_loss, tx, compile=True, layout=layout)
    eager = fb.make_train_step(model, torch.nn.functional.mse_loss, tx, compile=False)
    flat, flat_state = layout.flatten(params), fb.fuse(tx, layout).init(layout.flatten(params))
    state = tx.init(params)
    for t in range(steps):
        flat, flat_state, loss = compiled(flat, flat_state, batch)
        params, state, eager_loss = eager(params, state, batch)
        yield t, loss, eager_loss, layout.unflatten(flat), params


def fused_trace(tx, params: dict, grads: list) -> list:  # noqa: ANN001
    """The parameters after each step of ``fb.fuse(tx)`` over flat buffers of ``params``, as trees."""
    layout = fb.FlatLayout.of(params)
    fused = fb.fuse(tx, layout)
    flat = layout.flatten(params)
    return [
        layout.unflatten(f) for f in trace(fused.update, fused.init(flat), flat, [layout.flatten(g) for g in grads])
    ]
