"""Bagua's algorithm interface: tensors (ensure_bagua_tensor and the proxy's closures), buckets and
their operations, the backend that runs them in order, and algorithms a user writes to that
interface, on 2 gloo ranks against torch's DDP and this layer's built-in algorithms; the
autotuning service answered in process; the fused optimizer's module helpers."""

from __future__ import annotations

import pytest
import torch
from dist_harness import ScenarioError, run_ranks
from test_compat_bagua import assert_same, params_and_state

import functional_bagua.compat as bagua
from functional_bagua.compat.autotune import AutotuneClient, AutotuneService, in_order_buckets, run_flask_app
from functional_bagua.compat.backend import get_backend
from functional_bagua.compat.bucket import BaguaBucket
from functional_bagua.compat.communication import CommMember, comm, get_hyperparameters_service_client
from functional_bagua.compat.contrib.fuse import optimizer as fuse_module

# ---- tensors ---------------------------------------------------------------------------------


def test_a_proxy_reads_its_effective_tensor_anew_and_replaces_it_through_its_setter():
    p = torch.nn.Parameter(torch.ones(3))
    assert not p.is_bagua_tensor()
    assert p.bagua_ensure_grad() is p and torch.equal(p.grad, torch.zeros(3))
    p.ensure_bagua_tensor("w", "m", getter_closure=lambda t: t.grad, setter_closure=lambda t, g: setattr(t, "grad", g))
    assert p.is_bagua_tensor() and p.bagua_tensor_name == "w" and p.bagua_module_name == "m"
    p.grad = torch.full((3,), 2.0)  # a new gradient tensor: the proxy follows it
    assert p.bagua_getter_closure() is p.grad
    assert p.bagua_backend_tensor().data_ptr() == p.grad.data_ptr()
    assert p.bagua_backend_tensor().num_elements() == 3
    replacement = torch.full((3,), 5.0)
    p.bagua_setter_closure(replacement)
    assert p.grad is replacement


def test_ensure_bagua_tensor_refuses_a_rename_a_setter_alone_and_a_mark_without_a_module():
    t = torch.zeros(2).ensure_bagua_tensor("a", "m")
    with pytest.raises(ValueError, match="cannot be renamed 'b'"):
        t.ensure_bagua_tensor("b", "m")
    with pytest.raises(ValueError, match="belongs to module 'm' already"):
        t.ensure_bagua_tensor("a", "other")
    with pytest.raises(ValueError, match="setter_closure needs a getter_closure"):
        torch.zeros(2).ensure_bagua_tensor("c", "m", setter_closure=lambda t, v: None)
    with pytest.raises(RuntimeError, match="pass module_name"):
        torch.zeros(2).ensure_bagua_tensor("d").bagua_mark_communication_ready()
    with pytest.raises(RuntimeError, match="has no setter_closure"):
        t.bagua_setter_closure(torch.zeros(2))
    with pytest.raises(TypeError, match="only a torch.nn.Parameter"):
        torch.zeros(2).bagua_ensure_grad()


def test_to_bagua_tensor_shares_storage_and_set_storage_takes_the_storages_values():
    base = torch.arange(4.0)
    view = base.to_bagua_tensor("v")
    assert view is not base and view.data_ptr() == base.data_ptr() and not base.is_bagua_tensor()
    storage = torch.tensor([9.0, 8.0, 7.0, 6.0, 5.0])
    view.bagua_set_storage(storage.untyped_storage(), 1)
    assert torch.equal(view, torch.tensor([8.0, 7.0, 6.0, 5.0]))
    p = torch.nn.Parameter(torch.zeros(2)).bagua_ensure_grad()
    p.ensure_bagua_tensor("p", getter_closure=lambda t: t.grad, setter_closure=lambda t, g: setattr(t, "grad", g))
    p.bagua_set_storage(storage.untyped_storage(), 3)
    assert torch.equal(p.grad, torch.tensor([6.0, 5.0])) and p.grad.data_ptr() == storage[3:].data_ptr()


# ---- buckets and the backend -----------------------------------------------------------------


def proxies(module: str, *sizes: int) -> list:
    return [torch.arange(float(n)).add(10 * i).ensure_bagua_tensor(f"t{i}", module) for i, n in enumerate(sizes)]


def test_a_flattened_bucket_keeps_the_values_back_to_back_with_zero_padding():
    tensors = proxies("flat_bucket", 3, 2)
    before = [t.clone() for t in tensors]
    bucket = BaguaBucket(tensors, name="0", flatten=True, alignment=4)
    assert bucket.check_flatten()
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))
    assert torch.equal(bucket.flattened_tensor(), torch.cat(before + [torch.zeros(3)]))
    assert bucket.padding_tensor.numel() == 3 and bucket.bytes() == 5 * 4
    assert tensors[0].data_ptr() + 3 * 4 == tensors[1].data_ptr()  # one storage, in order


def test_a_bucket_not_flattened_leaves_its_tensors_where_they_are():
    tensors = proxies("loose_bucket", 3, 2)
    pointers = [t.data_ptr() for t in tensors]
    bucket = BaguaBucket(tensors, name="0", flatten=False)
    assert [t.data_ptr() for t in tensors] == pointers and bucket.padding_tensor is None


def test_buckets_refuse_plain_tensors_mixed_models_and_nothing():
    with pytest.raises(TypeError, match="ensure_bagua_tensor"):
        BaguaBucket([torch.zeros(2)], name="x", flatten=False)
    with pytest.raises(ValueError, match="belong to one model"):
        BaguaBucket(proxies("m1", 2) + [torch.zeros(1).ensure_bagua_tensor("z", "m2")], name="x", flatten=False)
    with pytest.raises(ValueError, match="at least one tensor"):
        BaguaBucket([], name="x", flatten=False)


def test_the_backend_runs_each_bucket_once_all_its_tensors_are_ready_in_registered_order():
    ran = []
    first, second = proxies("ordered", 2, 2), proxies("ordered", 1)
    second[0].bagua_tensor_name = "t9"  # names are per model
    second[0]._bagua_backend_tensor.name = "t9"
    buckets = [BaguaBucket(first, name="a", flatten=False), BaguaBucket(second, name="b", flatten=False)]
    for b in buckets:
        b.append_python_op(ran.append)
        b.append_python_op(lambda name: ran.append(name + "!"))
    backend = get_backend("ordered")
    backend.register_ordered_buckets([b.backend_bucket for b in buckets])
    second[0].bagua_mark_communication_ready()
    assert ran == []  # "b" waits for "a"
    first[0].bagua_mark_communication_ready()
    assert ran == []
    first[1].bagua_mark_communication_ready_without_synchronization()
    assert ran == ["a", "a!", "b", "b!"]
    assert backend.incomplete() == []
    first[1].bagua_mark_communication_ready()
    backend.wait_pending_comm_ops()  # as Bagua's: does not wait for a bucket not all marked
    assert backend.incomplete() == ["bucket 'a': ['t0']", "bucket 'b': ['t9']"]
    backend.start_round()
    first[0].bagua_mark_communication_ready()  # the round started again: "a" alone does not run yet
    assert ran == ["a", "a!", "b", "b!"]
    buckets[1].clear_ops()
    first[1].bagua_mark_communication_ready()
    second[0].bagua_mark_communication_ready()
    assert ran == ["a", "a!", "b", "b!", "a", "a!"]


def test_a_name_or_tensor_used_twice_and_mixed_kinds_are_refused_before_anything_moves():
    twins = proxies("twins", 2) + proxies("twins", 3)  # both named t0
    buckets = [BaguaBucket(twins[:1], name="a", flatten=False), BaguaBucket(twins[1:], name="b", flatten=False)]
    with pytest.raises(ValueError, match="'t0' of bucket 'b' is in bucket 'a' too"):
        get_backend("twins").register_ordered_buckets([b.backend_bucket for b in buckets])
    shared = proxies("shared", 2)
    again = [BaguaBucket(shared, name="a", flatten=False), BaguaBucket(shared, name="b", flatten=False)]
    with pytest.raises(ValueError, match="a tensor or a name used twice"):
        get_backend("shared").register_ordered_buckets([b.backend_bucket for b in again])
    mixed = [torch.ones(2).ensure_bagua_tensor("f32", "mixed"), torch.ones(2, dtype=torch.float64)]
    mixed[1].ensure_bagua_tensor("f64", "mixed")
    pointers = [t.data_ptr() for t in mixed]
    with pytest.raises(ValueError, match="share a dtype and a device"):
        BaguaBucket(mixed, name="m", flatten=True)
    assert [t.data_ptr() for t in mixed] == pointers and all(torch.equal(t, torch.ones(2)) for t in mixed)


def test_an_alignment_of_one_or_less_pads_nothing_and_a_missing_gradient_is_named():
    assert BaguaBucket(proxies("aligned", 3), name="0", flatten=True, alignment=0).padding_tensor is None
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="call param.bagua_ensure_grad"):
        p.ensure_bagua_tensor("g", "m", getter_closure=lambda t: t.grad)


def test_a_tensor_outside_the_registered_buckets_is_named():
    loose = torch.zeros(1).ensure_bagua_tensor("loose", "no_buckets")
    with pytest.raises(RuntimeError, match="'loose' is in no bucket registered"):
        loose.bagua_mark_communication_ready()


# ---- algorithms written to Bagua's interface, on 2 ranks --------------------------------------


@pytest.fixture(scope="module")
def two():
    names = [
        "centralized_against_torch_ddp",
        "compressed_gradients",
        "weight_algorithms",
        "operation_order",
        "bad_input",
        "shared_unique_id",
        "hook_state_and_resets",
        "lifetime",
    ]
    return run_ranks(2, names, module="bagua_interface_scenarios")


@pytest.fixture(scope="module")
def four():
    return run_ranks(4, ["weight_algorithms"], module="bagua_interface_scenarios")


def ok(result):
    assert not isinstance(result, ScenarioError), result
    return result


def test_gradient_buckets_written_to_baguas_interface_equal_torch_ddp_bit_for_bit(two):
    """float64, SGD with momentum and Adam: buckets of the default size, tiny ones (flattened
    or not) average the gradients as torch's DDP does, to the bit on 2 ranks."""
    for result in two:
        got = ok(result["centralized_against_torch_ddp"])
        for optimizer in ("sgd", "adam"):
            reference = got[f"torch/{optimizer}"]
            for key in [k for k in got if k.startswith(f"ours/{optimizer}/")]:
                assert_same(got[key], reference, params_and_state(reference))
        assert len(got["buckets/25.0/True"]) == 1
        assert len(got["buckets/0.0005/True"]) >= 2  # tiny buckets: several, each run in turn


def test_the_minmax_codec_gives_every_rank_the_same_bits_near_the_exact_average(two):
    runs = [ok(r["compressed_gradients"]) for r in two]
    for name, value in runs[0]["MinMaxUInt8"].items():
        assert torch.equal(value, runs[1]["MinMaxUInt8"][name]), name
        assert torch.equal(runs[0]["None"][name], runs[1]["None"][name]), name
        torch.testing.assert_close(value, runs[0]["None"][name], rtol=0, atol=0.05)
    assert any(not torch.equal(runs[0]["MinMaxUInt8"][n], runs[0]["None"][n]) for n in runs[0]["None"])


@pytest.mark.parametrize("case", ["all", "shift_one", "ring", "ring-two-optimizers", "all-interval-2"])
@pytest.mark.parametrize("world", ["two", "four"])
def test_weight_averaging_written_to_baguas_interface_equals_the_built_in_algorithm(world, case, request):
    """Decentralized SGD ("all", "shift_one", and "all" on every second step by Bagua's step
    counter) and the 8-bit ring (after each step, and with the parameters split between two
    optimizers, each marking its own), written with Bagua's bucket operations, step for step to
    the bit as this layer's DecentralizedAlgorithm and LowPrecisionDecentralizedAlgorithm (which
    test_compat_bagua.py checks against the rules written out); on 4 ranks shift_one's peers
    change from step to step. Gloo's 4-rank sum
    adds each element in an order that depends on its place in the buffer, and the bucket holds
    the weights last first: "all" on 4 ranks agrees to float64 rounding."""
    exact = not (world == "four" and case.startswith("all"))
    for result in request.getfixturevalue(world):
        got = ok(result["weight_algorithms"])
        user, builtin = got[f"{case}/user"], got[f"{case}/builtin"]
        assert len(user) == len(builtin) == 4
        for mine, theirs in zip(user, builtin):
            assert_same(mine, theirs, exact=exact)


def test_each_bucket_runs_once_per_backward_in_order_and_not_under_no_sync(two):
    for result in two:
        got = ok(result["operation_order"])
        assert len(got["buckets"]) >= 2
        assert got["ran"] == got["buckets"] * 3
        assert got["after_no_sync"] == got["ran"]


def test_what_a_bagua_interface_algorithm_gets_wrong_is_named(two):
    for result in two:
        errors = ok(result["bad_input"])
        assert errors["wrap_overriding_builtin"][0] == "TypeError"
        assert "overrides Bagua's hooks ['init_operations']" in errors["wrap_overriding_builtin"][1]
        assert "GradientAllReduceAlgorithmImpl" in errors["wrap_overriding_builtin"][1]
        assert errors["unused_parameter"][0] == "RuntimeError"
        assert "unused.weight" in errors["unused_parameter"][1] and "did not arrive" in errors["unused_parameter"][1]
        assert errors["wrong_peer_weight"] == (
            "ValueError",
            "BaguaBucket 'b': peer_weight is (3,) torch.float32 on cpu, the bucket flat (4,) torch.float64 on cpu; "
            "make it with bucket.flattened_tensor().ensure_bagua_tensor(...)",
        )
        assert errors["find_unused_parameters"][0] == "ValueError"
        assert "find_unused_parameters=True is not supported" in errors["find_unused_parameters"][1]
        assert errors["shadowing_attribute"][0] == "TypeError" and "['buckets']" in errors["shadowing_attribute"][1]
        assert errors["asynchronous_op"][0] == "NotImplementedError"
        assert "AsyncModelAverageAlgorithm" in errors["asynchronous_op"][1]
        assert errors["unknown_codec"][0] == "ValueError" and "'fp8'" in errors["unknown_codec"][1]


def test_a_shared_unique_id_is_the_roots_on_every_rank(two):
    ids = [ok(r["shared_unique_id"]) for r in two]
    assert ids[0] == ids[1]
    first, second = ids[0]
    assert first != second and len(first) == 256 and set(first) <= set("0123456789abcdef")


def test_the_post_step_hook_is_made_once_and_an_eval_forward_does_not_reset(two):
    """The post-step hook's closure keeps its state across steps (Bagua makes it once per init);
    a reset asked for after the first step happens at the next training forward on every rank,
    not at rank 0's evaluation forward before it (the ranks would wait on each other's broadcasts)."""
    for rank, result in enumerate(two):
        got = ok(result["hook_state_and_resets"])
        assert got["inits"] == 2
        assert got["inits_after_eval"] == (1 if rank == 0 else None)
        assert got["counts"] == [1, 1, 2]  # the reset made a new hook, whose closure counts anew


def test_a_dropped_model_leaves_nothing_alive(two):
    for result in two:
        got = ok(result["lifetime"])
        assert got == dict(alive=[False, False, False], buckets=0)


# ---- the autotuning service, the world communicator, the fused optimizer's helpers ----------


def test_the_service_suggests_buckets_in_order_by_dtype_and_size():
    tensors = [torch.zeros(10), torch.zeros(10, dtype=torch.float16), torch.zeros(30), torch.zeros(5)]
    assert in_order_buckets(tensors, 100) == [[0, 2], [1], [3]]  # 40 + 120 bytes close the first
    declarations = [
        {"name": str(i), "num_elements": t.numel(), "dtype": {torch.float32: "f32", torch.float16: "f16"}[t.dtype]}
        for i, t in enumerate(tensors)
    ]
    service = AutotuneService(world_size=2, default_bucket_size=100)
    service.register_tensors("model", declarations)
    answer = service.ask_hyperparameters("model", rank=0, train_iter=0)
    assert [[d["name"] for d in b] for b in answer["recommended_hyperparameters"]["buckets"]] == [
        ["0", "2"],
        ["1"],
        ["3"],
    ]
    assert answer["is_autotune_completed"] is True
    service.register_tensors("model", declarations, whether_to_bucket=False)  # one bucket per dtype
    unbucketed = service.ask_hyperparameters("model", 1, 5)["recommended_hyperparameters"]["buckets"]
    assert [[d["name"] for d in b] for b in unbucketed] == [["0", "2", "3"], ["1"]]
    with pytest.raises(ValueError, match="does not tune"):
        AutotuneService(world_size=2, autotune_level=1)
    with pytest.raises(KeyError, match="no tensors registered for model 'other'"):
        service.ask_hyperparameters("other", 0, 0)


def test_the_client_is_answered_in_process():
    client = get_hyperparameters_service_client()
    assert isinstance(client, AutotuneClient) and client.health_check()
    rsp = client.register_tensors("client_model", [{"name": "w", "num_elements": 4, "dtype": "f32"}])
    assert rsp.status_code == 200
    buckets = client.ask_hyperparameters("client_model", 0, 0).json()["recommended_hyperparameters"]["buckets"]
    assert [[d["name"] for d in b] for b in buckets] == [["w"]]
    assert client.report_metrics("client_model", 0, 1, {}, 1.0).status_code == 200
    with pytest.raises(NotImplementedError, match="no HTTP autotuning service"):
        run_flask_app(0)


def test_comm_world_is_the_default_group_member():
    assert comm.WORLD is CommMember.WORLD
    assert bagua.get_backend("same") is bagua.get_backend("same")


def test_make_optimizer_instance_copies_groups_without_state_and_bagua_s_steps_name_fuse_step():
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([{"params": [p], "lr": 0.5}, {"params": [q]}], lr=0.1, momentum=0.9)
    p.grad, q.grad = torch.ones(2), torch.ones(3)
    opt.step()
    copy = fuse_module.make_optimizer_instance(opt)
    assert [g["lr"] for g in copy.param_groups] == [0.5, 0.1] and copy.param_groups[0]["params"][0] is p
    assert len(copy.state) == 0 and len(opt.state) == 2
    assert copy.param_groups[0] is not opt.param_groups[0]
    for name in ("do_fuse", "sync_optimizer_state", "check_optimizer"):
        with pytest.raises(NotImplementedError, match="call fuse_step"):
            getattr(fuse_module, name)(opt)
