"""The helpers of Bagua's ``contrib.fuse.optimizer`` module: flattening tensors reached through
closures (values kept, memory back to back; a training step after it equals torch.optim's on an
unflattened copy), groups of back-to-back tensors, and a torch optimizer's per-parameter state
split into tensors and scalars, cut back from a flat parameter, and group settings copied."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from devices import seeded

from functional_bagua.compat.contrib.fuse import optimizer as fo
from functional_bagua.compat.utils import check_contiguous


def model_and_adam():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def train(model, opt, steps=3, seed=1):
    gen = seeded(seed)
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        model(torch.randn(5, 4, generator=gen)).pow(2).sum().backward()
        opt.step()


def test_flatten_tensors_with_closure_keeps_values_and_lays_them_back_to_back():
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(2, 3), (4,), (1, 5)]]
    before = [p.detach().clone() for p in params]
    fo.flatten_tensors_with_closure(params, lambda p: p.data, lambda p, t: setattr(p, "data", t))
    assert check_contiguous([p.data for p in params])
    assert all(torch.equal(p.data, b) for p, b in zip(params, before))
    assert params[2].data_ptr() == params[0].data_ptr() + 10 * 4
    where = [p.data_ptr() for p in params]
    set_calls = []
    fo.flatten_tensors_with_closure(params, lambda p: p.data, lambda p, t: set_calls.append(p))
    assert set_calls == [] and [p.data_ptr() for p in params] == where  # already back to back: left as it is


def test_flatten_params_and_states_then_steps_as_torch_optim_on_a_copy():
    model, opt = model_and_adam()
    train(model, opt)
    reference = copy.deepcopy(model)
    reference_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    reference_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own tensors (loading shares them)
    fo.flatten_params_and_states(opt)
    params = list(model.parameters())
    assert check_contiguous([p.data for p in params]) and check_contiguous([p.grad for p in params])
    for name in ("exp_avg", "exp_avg_sq"):
        assert check_contiguous([opt.state[p][name] for p in params])
    train(model, opt, seed=2)
    train(reference, reference_opt, seed=2)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_groups_of_back_to_back_tensors_make_one_flat_tensor():
    flat = torch.arange(10.0)
    views = [flat[0:3], flat[3:7], flat[7:10], torch.zeros(2)]
    storage, numel, dtype, device = fo.group_tensors(views, [0, 1, 2])
    assert (numel, dtype, device) == (10, torch.float32, flat.device)
    made = fo._create_tensor(storage, numel, dtype, device)
    assert torch.equal(made, flat) and made.data_ptr() == flat.data_ptr()
    assert fo._can_reuse_tensor(made, storage, 10, dtype, device)
    assert not fo._can_reuse_tensor(torch.arange(10.0), storage, 10, dtype, device)
    assert not fo._can_reuse_tensor(made, storage, 9, dtype, device) and not fo._can_reuse_tensor(
        None, storage, 10, dtype, device
    )
    assert fo.group_tensors(views, []) is None
    with pytest.raises(AssertionError, match="contiguous"):
        fo.group_tensors(views, [0, 3])


def test_the_state_splits_into_tensors_and_scalars():
    model, _ = model_and_adam()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    train(model, opt)
    for p in params:
        opt.state[p]["calls"] = 3  # a scalar, the same for every parameter
    tensors, scalars = fo.get_optimizer_param_states(opt, params)
    assert list(tensors) == ["momentum_buffer"] and scalars == {"calls": 3}
    assert all(t is opt.state[p]["momentum_buffer"] for t, p in zip(tensors["momentum_buffer"], params))
    assert fo.get_tensor_state(opt, params[0], "momentum_buffer") is opt.state[params[0]]["momentum_buffer"]


@pytest.mark.parametrize("spoil", ["missing", "differing scalar"])
def test_state_that_differs_between_parameters_is_refused_with_an_error_logged(spoil, caplog):
    model, opt = model_and_adam()
    train(model, opt)
    params = list(model.parameters())
    for p in params:
        opt.state[p]["calls"] = 3
    if spoil == "missing":
        del opt.state[params[1]]["exp_avg"]
    else:
        opt.state[params[1]]["calls"] = 4
    with caplog.at_level(logging.ERROR):
        assert fo.get_optimizer_param_states(opt, params) == (None, None)
    assert "failed not fuse optimizer" in caplog.text


def test_a_flat_parameters_state_is_cut_back_into_its_members_shapes(caplog):
    model, opt = model_and_adam()
    train(model, opt)
    members = list(model[0].parameters())  # weight (3, 4), bias (3,)
    flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in members]))
    opt.state[flat]["exp_avg"] = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in members])
    views = fo.infer_state_tensors(opt, flat, members, "exp_avg")
    assert [v.shape for v in views] == [p.shape for p in members]
    assert all(torch.equal(v, opt.state[p]["exp_avg"]) for v, p in zip(views, members))
    assert views[1].data_ptr() == opt.state[flat]["exp_avg"].data_ptr() + 12 * 4  # views, not copies
    for wrong in (torch.zeros(14), torch.zeros(16), torch.zeros(15, dtype=torch.float64)):
        opt.state[flat]["exp_avg"] = wrong
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert fo.infer_state_tensors(opt, flat, members, "exp_avg") is None
        assert "ambiguous parameter state" in caplog.text


def test_group_settings_are_copied_and_those_missing_set_to_none():
    src = {"params": [1], "lr": 0.1, "betas": (0.9, 0.99)}
    dst = {"params": [2], "lr": 0.5, "momentum": 0.9}
    fo.sync_param_group_scalars(src, dst)
    assert dst == {"params": [2], "lr": 0.1, "betas": (0.9, 0.99), "momentum": None}
