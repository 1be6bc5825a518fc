"""fb.sparse_adam against torch.optim.SparseAdam on an nn.Embedding(sparse=True)."""

from __future__ import annotations

import pytest
import torch
from devices import ON_CUDA, seeded

import functional_bagua as fb


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(
    "kwargs", [dict(lr=1e-2), dict(lr=3e-2, betas=(0.8, 0.99), eps=1e-6, maximize=True)], ids=["default", "maximize"]
)
def test_sparse_adam_equals_torch_sparse_adam_bit_for_bit(kwargs, dtype):
    torch.manual_seed(0)
    model, reference = (
        torch.nn.Embedding(30, 4, sparse=True).to(dtype),
        torch.nn.Embedding(30, 4, sparse=True).to(dtype),
    )
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SparseAdam(reference.parameters(), **kwargs)
    tx = fb.sparse_adam(**kwargs)
    params = fb.params_of(model)
    state = tx.init(params)
    gen = seeded(1)
    for _ in range(6):
        rows = torch.randint(0, 30, (9,), generator=gen)  # repeated rows: the gradient holds duplicates
        optimizer.zero_grad()
        reference(rows).square().sum().backward()
        optimizer.step()
        grads = torch.func.grad(lambda p: torch.func.functional_call(model, p, (rows,)).square().sum())(params)
        assert grads["weight"].layout == torch.sparse_coo
        updates, state = tx.update(grads, state, params)
        params = fb.apply_updates(params, updates)
    # bit for bit on the CPU; on CUDA to float64 rounding: with maximize=True the last bits of some
    # entries of the parameter and of exp_avg_sq differed on an H200 (exp_avg was equal)
    tol = dict(rtol=1e-14, atol=1e-16) if ON_CUDA else dict(rtol=0, atol=0)
    torch.testing.assert_close(params["weight"], reference.weight.detach(), **tol)
    torch_state = optimizer.state[reference.weight]
    torch.testing.assert_close(state.mu["weight"], torch_state["exp_avg"], **tol)
    torch.testing.assert_close(state.nu["weight"], torch_state["exp_avg_sq"], **tol)
    assert int(state.count["weight"]) == torch_state["step"]


def test_sparse_adam_refuses_dense_gradients_as_torch_does():
    params = {"w": torch.zeros(3, 2)}
    tx = fb.sparse_adam()
    with pytest.raises(
        TypeError, match="gradient of 'w' is dense; scale_by_sparse_adam takes sparse COO gradients only"
    ):
        tx.update({"w": torch.ones(3, 2)}, tx.init(params), params)
    with pytest.raises(TypeError, match="gradient of 'w' is sparse coo; sparse gradients are not supported"):
        fb.adam().update({"w": torch.ones(3, 2).to_sparse()}, fb.adam().init(params), params)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        fb.sparse_adam(lr=-1.0)
