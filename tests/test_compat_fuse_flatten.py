"""functional_bagua.compat.fuse_optimizer's flat buffers: with do_flatten, parameters,
gradients and state live in one buffer per group and dtype (without it they stay in place); a
fused step hands the optimizer a few views; a replaced ``p.data`` is noticed and flattened again;
large parameters are stepped alone; runs cut into chunks mid-parameter still match.

Reference: the same optimizer class on an identical copy of the parameters, stepped with plain
``step()`` on the same gradients.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from compat_helpers import assert_same, make_optimizer, make_params, run_both, set_grads

from functional_bagua.compat import fuse_optimizer


def test_do_flatten_puts_params_grads_and_state_in_one_buffer_per_group_and_dtype():
    groups = make_params()
    ids = [[id(p) for p in ps] for ps in groups]
    opt = fuse_optimizer(torch.optim.Adam([{"params": groups[0]}, {"params": groups[1]}], lr=1e-2))
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == ids  # identity kept
    set_grads(groups, 0)
    opt.fuse_step()
    for params in groups:
        for dtype in (torch.float32, torch.float64):
            members = [p for p in params if p.requires_grad and p.dtype == dtype]
            if len(members) < 2:
                continue
            base = members[0].data_ptr()
            grads = [(p, p.grad) for p in members if p.grad is not None]
            states = [(p, opt.state[p]["exp_avg"]) for p in members if p in opt.state]
            for pairs in (grads, states):
                # one storage, laid out like the parameters (an unused parameter leaves a gap)
                assert len({t.untyped_storage().data_ptr() for _, t in pairs}) == 1
                start = pairs[0][1].data_ptr() - (pairs[0][0].data_ptr() - base)
                assert all(t.data_ptr() - start == p.data_ptr() - base for p, t in pairs)
            assert all(
                a.data_ptr() + a.numel() * a.element_size() == b.data_ptr() for a, b in zip(members, members[1:])
            )
    # the scalar step stays a separate 0-dim tensor per parameter
    steps = [opt.state[p]["step"] for p in groups[0] if p in opt.state]
    assert all(s.dim() == 0 for s in steps) and len({id(s) for s in steps}) == len(steps)


def test_do_flatten_false_leaves_params_in_place_and_still_matches():
    ref_groups, groups = make_params(), make_params()
    pointers = [p.data_ptr() for p in groups[0]]
    ref_opt = make_optimizer("AdamW", "for-loop", ref_groups)
    opt = fuse_optimizer(make_optimizer("AdamW", "for-loop", groups), do_flatten=False)
    assert [p.data_ptr() for p in groups[0]] == pointers
    run_both(ref_groups, groups, ref_opt, opt, 6)
    assert_same(ref_groups, groups, ref_opt, opt)
    assert [p.data_ptr() for p in groups[0]] == pointers


def test_flattened_group_fuses_into_few_views():
    """A fused step hands the optimizer one view per run: the unused and frozen parameters cut
    group 0 into runs; float64 and float32 make two runs in group 1."""
    groups = make_params()
    opt = fuse_optimizer(make_optimizer("SGD", "for-loop", groups))
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append([len(g["params"]) for g in o.param_groups]))
    set_grads(groups, 0)
    opt.fuse_step()
    # group 0: runs [0..2] and [5..6] + the unused and frozen params stepped as they are
    # group 1: a float64 run of 3 and a float32 run of 2
    assert seen == [[2 + 2, 2]]


@pytest.mark.parametrize("check_flatten", [True, False])
def test_replaced_param_data_stays_correct_and_warns_once(check_flatten):
    ref_groups, groups = make_params(), make_params()
    ref_opt = make_optimizer("Adam", "for-loop", ref_groups)
    opt = fuse_optimizer(make_optimizer("Adam", "for-loop", groups), check_flatten=check_flatten)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(8):
            if t in (2, 5):  # the user replaces storage behind the optimizer's back
                for ps in (ref_groups[0], groups[0]):
                    ps[1].data = ps[1].data.clone()
                    ps[5].data = ps[5].data * 1.0
            set_grads(ref_groups, t)
            set_grads(groups, t)
            ref_opt.step()
            opt.fuse_step()
    assert_same(ref_groups, groups, ref_opt, opt)
    moved = [w for w in caught if "no longer live in the flat buffers" in str(w.message)]
    assert len(moved) == (1 if check_flatten else 0)
    if check_flatten:  # flattened again: back to one buffer
        assert groups[0][1].data_ptr() + 3 * 4 == groups[0][2].data_ptr()


@pytest.mark.parametrize("name", ["Adam", "Rprop", "ASGD", "Adagrad", "SGD"])
def test_runs_cut_into_chunks_mid_parameter_still_match(name, monkeypatch):
    """On the CPU a run is handed to the optimizer in pieces of at most CPU_CHUNK_BYTES; pieces
    cut parameters in two and the optimizer makes state per piece. Tiny pieces here (10
    elements) to exercise that."""
    import functional_bagua.compat.runs as runs

    monkeypatch.setattr(runs, "CPU_CHUNK_BYTES", 40)
    ref_groups, groups = make_params(), make_params()
    ref_opt = make_optimizer(name, "foreach", ref_groups)
    opt = fuse_optimizer(make_optimizer(name, "foreach", groups))
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(len(o.param_groups[0]["params"])))
    for t in range(12):
        set_grads(ref_groups, t)
        set_grads(groups, t)
        ref_opt.step()
        (opt.fuse_step if t % 3 else opt.step)()
    assert_same(ref_groups, groups, ref_opt, opt)
    # group 0's runs hold 15+3+16 and 7+3 elements: 4 + 1 pieces, plus 2 parameters stepped alone
    assert seen[0] == 4 + 1 + 2


@pytest.mark.cpu_only("the size cap applies to CPU parameters only")
def test_large_parameters_on_the_cpu_are_stepped_alone(monkeypatch):
    """Above CPU_FUSE_MAX_NUMEL elements a parameter is not fused (nothing to gain, a gradient
    copy to lose); results stay the same."""
    import functional_bagua.compat.runs as runs

    monkeypatch.setattr(runs, "CPU_FUSE_MAX_NUMEL", 6)
    ref_groups, groups = make_params(), make_params()
    ref_opt = make_optimizer("NAdam", "for-loop", ref_groups)
    opt = fuse_optimizer(make_optimizer("NAdam", "for-loop", groups))
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append([len(g["params"]) for g in o.param_groups]))
    run_both(ref_groups, groups, ref_opt, opt, 4)
    assert_same(ref_groups, groups, ref_opt, opt)
    # large parameters are not moved into the flat buffers either: they keep their own storage
    for ps in groups:
        for p in ps:
            if p.numel() > 6 or not p.requires_grad:
                assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
    # group 0: only (3,) and (3, 1) are small, and they are not neighbours: nothing to fuse there.
    # group 1: float64 (6,) sits between (3, 2) and (2, 3), all <= 6: one run; float32 (2, 2), (5,): one run
    assert seen[0] == [7, 2]


def test_mutual_groups_of_back_to_back_tensors_as_bagua_computes_them():
    """Bagua's contrib.fuse.optimizer.calculate_mutual_groups: per list, the runs of positions
    whose tensors lie back to back (address order, two or more); across lists, the runs all share."""
    from functional_bagua.compat.contrib.fuse.optimizer import (
        _find_continuous_tensors,
        _is_contiguous_tensor,
        calculate_mutual_groups,
    )

    params, state = torch.zeros(60), torch.zeros(60)
    p = [params[i * 6 : (i + 1) * 6] for i in range(10)]
    s = [state[i * 6 : (i + 1) * 6] for i in range(10)]
    assert (
        _is_contiguous_tensor(p[2], p[1])
        and _is_contiguous_tensor(p[1], p[2])
        and not _is_contiguous_tensor(p[1], p[3])
    )
    # positions 0-2 hold pieces 5, 4, 6 (back to back in address order 1, 0, 2); 3 and 4 hold 8, 9
    first = [p[5], p[4], p[6], p[8], p[9], torch.zeros(6)]
    assert _find_continuous_tensors(first) == [[1, 0, 2], [3, 4]]
    same_layout = [s[5], s[4], s[6], s[8], s[9], torch.zeros(6)]
    assert calculate_mutual_groups([first, same_layout]) == [[1, 0, 2], [3, 4]]
    broken = [s[5], s[4], torch.zeros(6), s[8], s[9], torch.zeros(6)]  # position 2 elsewhere
    assert calculate_mutual_groups([first, broken]) == [[3, 4]]
    apart = [torch.zeros(6) for _ in first]
    assert calculate_mutual_groups([first, apart]) == [] and calculate_mutual_groups([]) == []
    with pytest.raises(AssertionError, match="equal size"):
        calculate_mutual_groups([first, first[:3]])
