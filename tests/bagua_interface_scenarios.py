"""Algorithms written to Bagua's own interface (init_tensors, tensors_to_buckets, init_operations
and the hook factories), as a Bagua user writes them, run on each gloo rank by
dist_harness.run_ranks (module "bagua_interface_scenarios"); test_compat_bagua_interface.py checks
them against torch's DDP and this layer's built-in algorithms."""

from __future__ import annotations

import torch
from bagua_scenarios import DTYPE, OPTIMIZERS, SGD_LR, TINY_BUCKETS_MB, local_batches, state_of, torch_ddp, train
from helpers import errors_of
from models import loss_fn, make_model

import functional_bagua.compat as bagua
from functional_bagua.compat.algorithms import Algorithm, AlgorithmImpl, decentralized, gradient_allreduce
from functional_bagua.compat.bucket import BaguaBucket


class CentralizedImpl(AlgorithmImpl):
    """Gradients averaged by each bucket's centralized operation; everything else Bagua's defaults."""

    def __init__(self, process_group, compression=None):  # noqa: ANN001
        super().__init__(process_group)
        self.compression = compression

    def init_operations(self, bagua_ddp, bucket):  # noqa: ANN001
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(average=True, compression=self.compression, group=self.process_group)


class Centralized(Algorithm):
    def __init__(self, compression=None):  # noqa: ANN001
        self.compression = compression

    def reify(self, process_group):  # noqa: ANN001
        return CentralizedImpl(process_group, self.compression)


class WeightsImpl(AlgorithmImpl):
    """The weights themselves as the communicated tensors, in one bucket (what Bagua's
    decentralized algorithms do)."""

    def init_tensors(self, bagua_ddp):  # noqa: ANN001
        self.weights = [
            p.ensure_bagua_tensor(name, bagua_ddp.bagua_module_name)
            for name, p in reversed(bagua_ddp.bagua_build_params())
        ]
        return self.weights

    def tensors_to_buckets(self, tensors, do_flatten):  # noqa: ANN001
        return [BaguaBucket([t for group in tensors for t in group], name="weights", flatten=do_flatten)]

    def init_backward_hook(self, bagua_ddp):  # noqa: ANN001
        return lambda name, param: None


class PeerAverageImpl(WeightsImpl):
    """Decentralized SGD: the average launched before the forward, copied back after backward,
    on every ``interval``-th training step (Bagua's step counter)."""

    def __init__(self, process_group, mode, interval=1):  # noqa: ANN001
        super().__init__(process_group)
        self.mode, self.interval = mode, interval

    def communicates(self, bagua_ddp) -> bool:  # noqa: ANN001
        return (bagua_ddp.bagua_train_step_counter - 1) % self.interval == 0

    def init_operations(self, bagua_ddp, bucket):  # noqa: ANN001
        bucket.clear_ops()
        bucket.peer = bucket.flattened_tensor().ensure_bagua_tensor("peer_weight")
        bucket.op = bucket.append_decentralized_synchronous_op(
            bucket.peer, peer_selection_mode=self.mode, group=self.process_group
        )

    def init_forward_pre_hook(self, bagua_ddp):  # noqa: ANN001
        def hook(inputs):  # noqa: ANN001
            if self.communicates(bagua_ddp):
                for t in self.weights:
                    t.bagua_mark_communication_ready()

        return hook

    def init_post_backward_hook(self, bagua_ddp):  # noqa: ANN001
        def hook():
            if self.communicates(bagua_ddp):
                bagua_ddp._bagua_backend.wait_pending_comm_ops()
                for bucket in bagua_ddp.bagua_buckets:
                    bucket.op.copy_back_peer_weight(bucket.backend_bucket)

        return hook


class PeerAverage(Algorithm):
    def __init__(self, mode, interval=1):  # noqa: ANN001
        self.mode, self.interval = mode, interval

    def reify(self, process_group):  # noqa: ANN001
        return PeerAverageImpl(process_group, self.mode, self.interval)


class RingImpl(WeightsImpl):
    """8-bit decentralized SGD with the ring neighbours, after each optimizer step."""

    def init_operations(self, bagua_ddp, bucket):  # noqa: ANN001
        bucket.clear_ops()
        replicas = [bucket.flattened_tensor().ensure_bagua_tensor(n) for n in ("weight", "left", "right")]
        bucket.append_low_precision_decentralized_synchronous_op(*replicas, group=self.process_group)

    def init_post_optimizer_step_hook(self, bagua_ddp):  # noqa: ANN001
        def hook(optimizer):  # noqa: ANN001
            for group in optimizer.param_groups:  # this optimizer's parameters: the bucket runs after the last
                for p in group["params"]:
                    if p.is_bagua_tensor():
                        p.bagua_mark_communication_ready()
            bagua_ddp._bagua_backend.wait_pending_comm_ops()

        return hook


class Ring(Algorithm):
    def reify(self, process_group):  # noqa: ANN001
        return RingImpl(process_group)


class RecordingImpl(CentralizedImpl):
    """A Python operation after each bucket's average, recording which bucket ran."""

    ran: list = []

    def init_operations(self, bagua_ddp, bucket):  # noqa: ANN001
        super().init_operations(bagua_ddp, bucket)
        bucket.append_python_op(self.ran.append)


class Recording(Algorithm):
    def reify(self, process_group):  # noqa: ANN001
        return RecordingImpl(process_group)


def centralized_against_torch_ddp(rank: int, world_size: int) -> dict:
    """Centralized buckets (default and tiny sizes, flattened or not) and torch's DDP, with SGD
    (momentum) and Adam, on the same seeds and data."""
    results = {}
    for optimizer in OPTIMIZERS:
        results[f"torch/{optimizer}"] = torch_ddp(rank, world_size, "norm", optimizer)
        for cap, flatten in ((25.0, True), (TINY_BUCKETS_MB, True), (TINY_BUCKETS_MB, False)):
            model = make_model("norm", DTYPE, seed=rank)
            opt = OPTIMIZERS[optimizer](model.parameters())
            net = bagua.data_parallel.DistributedDataParallel(
                model, optimizers=[opt], algorithm=Centralized(), bucket_cap_mb=cap, gradient_as_bucket_view=flatten
            )
            train(net, opt, local_batches(rank, world_size))
            results[f"ours/{optimizer}/{cap}/{flatten}"] = state_of(model, opt)
            results[f"buckets/{cap}/{flatten}"] = [len(b.tensors) for b in model.bagua_buckets]
    return results


def compressed_gradients(rank: int, world_size: int) -> dict:
    """Centralized buckets with Bagua's MinMaxUInt8 codec, and in full precision."""
    out = {}
    for compression in (None, "MinMaxUInt8"):
        model = make_model("shapes", DTYPE, seed=rank)
        opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
        model.with_bagua([opt], Centralized(compression))
        train(model, opt, local_batches(rank, world_size))
        out[str(compression)] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def sgd_trace(rank: int, world_size: int, algorithm: Algorithm, optimizers: int = 1) -> list:
    """Plain SGD on the "shapes" model wrapped with ``algorithm``: the parameters after each step
    (``optimizers=2``: the parameters split between two optimizers, stepped in turn)."""
    model = make_model("shapes", DTYPE, seed=rank)
    params = list(model.parameters())
    opts = [torch.optim.SGD(params[i::optimizers], lr=SGD_LR) for i in range(optimizers)]
    model.with_bagua(opts, algorithm)
    trace = []
    for x, y in local_batches(rank, world_size):
        for opt in opts:
            opt.zero_grad()
        loss_fn(model(x), y).backward()
        for opt in opts:
            opt.step()
        trace.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return trace


def weight_algorithms(rank: int, world_size: int) -> dict:
    """The decentralized and ring algorithms written to Bagua's interface, and this layer's own."""
    return {
        "all/user": sgd_trace(rank, world_size, PeerAverage("all")),
        "all/builtin": sgd_trace(rank, world_size, decentralized.DecentralizedAlgorithm(peer_selection_mode="all")),
        "shift_one/user": sgd_trace(rank, world_size, PeerAverage("shift_one")),
        "shift_one/builtin": sgd_trace(
            rank, world_size, decentralized.DecentralizedAlgorithm(peer_selection_mode="shift_one")
        ),
        "ring/user": sgd_trace(rank, world_size, Ring()),
        "ring/builtin": sgd_trace(rank, world_size, decentralized.LowPrecisionDecentralizedAlgorithm()),
        "ring-two-optimizers/user": sgd_trace(rank, world_size, Ring(), optimizers=2),
        "ring-two-optimizers/builtin": sgd_trace(
            rank, world_size, decentralized.LowPrecisionDecentralizedAlgorithm(), optimizers=2
        ),
        "all-interval-2/user": sgd_trace(rank, world_size, PeerAverage("all", interval=2)),
        "all-interval-2/builtin": sgd_trace(
            rank, world_size, decentralized.DecentralizedAlgorithm(communication_interval=2)
        ),
    }


def operation_order(rank: int, world_size: int) -> dict:
    """The buckets' Python operations, recorded over 3 steps with tiny buckets, and under no_sync."""
    RecordingImpl.ran = []
    model = make_model("norm", DTYPE, seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    net = bagua.data_parallel.DistributedDataParallel(
        model, optimizers=[opt], algorithm=Recording(), bucket_cap_mb=TINY_BUCKETS_MB
    )
    data = local_batches(rank, world_size, steps=3)
    train(net, opt, data)
    buckets = [b.name for b in model.bagua_buckets]
    ran_before_no_sync = list(RecordingImpl.ran)
    with net.no_sync():
        loss_fn(net(data[0][0]), data[0][1]).backward()
    return dict(ran=ran_before_no_sync, after_no_sync=list(RecordingImpl.ran), buckets=buckets)


class OverridingBuiltin(gradient_allreduce.GradientAllReduceAlgorithmImpl):
    def init_operations(self, bagua_ddp, bucket):  # noqa: ANN001
        pass


class OverridingBuiltinAlgorithm(Algorithm):
    def reify(self, process_group):  # noqa: ANN001
        return OverridingBuiltin(process_group)


class ShadowingImpl(CentralizedImpl):
    def tensors_to_buckets(self, tensors, do_flatten):  # noqa: ANN001
        self.buckets = super().tensors_to_buckets(tensors, do_flatten)
        return self.buckets


class Shadowing(Algorithm):
    def reify(self, process_group):  # noqa: ANN001
        return ShadowingImpl(process_group)


class Unused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = torch.nn.Linear(3, 1).double(), torch.nn.Linear(3, 1).double()

    def forward(self, x):  # noqa: ANN001
        return self.used(x)


def bad_input(rank: int, world_size: int) -> dict:
    """What a Bagua-interface algorithm gets wrong, each refused with a named error."""

    def wrap_overriding_builtin():
        model = make_model("shapes", DTYPE, seed=0)
        model.with_bagua([torch.optim.SGD(model.parameters(), lr=0.1)], OverridingBuiltinAlgorithm())

    def unused_parameter():
        model = Unused()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.with_bagua([opt], Centralized())
        opt.zero_grad()
        model(torch.ones(2, 3, dtype=DTYPE)).sum().backward()

    def bucket_of(module_name):  # noqa: ANN001
        return BaguaBucket(
            [torch.zeros(4, dtype=DTYPE).ensure_bagua_tensor(f"t{rank}", module_name)], name="b", flatten=False
        )

    def wrong_peer_weight():
        bucket = bucket_of("bad_input_peer")
        bucket.append_decentralized_synchronous_op(torch.zeros(3).ensure_bagua_tensor("peer"))

    def asynchronous_op():
        bucket_of("bad_input_async").append_asynchronous_model_average_op("all")

    def unknown_codec():
        bucket_of("bad_input_codec").append_centralized_synchronous_op(compression="fp8")

    def find_unused_parameters():
        model = make_model("shapes", DTYPE, seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        bagua.data_parallel.DistributedDataParallel(
            model, optimizers=[opt], algorithm=Centralized(), find_unused_parameters=True
        )

    def shadowing_attribute():
        model = make_model("shapes", DTYPE, seed=0)
        model.with_bagua([torch.optim.SGD(model.parameters(), lr=0.1)], Shadowing())

    cases = dict(
        find_unused_parameters=find_unused_parameters,
        shadowing_attribute=shadowing_attribute,
        wrap_overriding_builtin=wrap_overriding_builtin,
        unused_parameter=unused_parameter,
        wrong_peer_weight=wrong_peer_weight,
        asynchronous_op=asynchronous_op,
        unknown_codec=unknown_codec,
    )
    return errors_of(cases)


def shared_unique_id(rank: int, world_size: int) -> list:
    """broadcast_nccl_unique_id: rank 1 makes the ids, every rank reads them."""
    from functional_bagua.compat.communication import broadcast_nccl_unique_id

    if not bagua.is_initialized():
        bagua.init_process_group()
    return [broadcast_nccl_unique_id(f"test_unique_id_{i}", root=1) for i in range(2)]


class StatefulImpl(CentralizedImpl):
    """A post-step hook whose closure counts its calls, and a reset asked for after the first step."""

    def __init__(self, process_group):  # noqa: ANN001
        super().__init__(process_group)
        self.counts: list = []
        self.inits = 0
        self.wants_reset = False

    def need_reset(self) -> bool:
        return self.wants_reset

    def init_tensors(self, bagua_ddp):  # noqa: ANN001
        self.inits += 1
        self.wants_reset = False
        return super().init_tensors(bagua_ddp)

    def init_post_optimizer_step_hook(self, bagua_ddp):  # noqa: ANN001
        calls = []

        def hook(optimizer):  # noqa: ANN001
            calls.append(len(calls) + 1)
            self.counts.append(len(calls))
            self.wants_reset = len(self.counts) == 1

        return hook


class Stateful(Algorithm):
    def reify(self, process_group):  # noqa: ANN001
        return StatefulImpl(process_group)


def hook_state_and_resets(rank: int, world_size: int) -> dict:
    """Three steps; after the first the algorithm asks for a reset, and rank 0 runs an evaluation
    forward (eval mode) before the second: only the training forward resets, on every rank."""
    model = make_model("shapes", DTYPE, seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    model.with_bagua([opt], Stateful())
    impl = vars(model)["_bagua_engine"].bagua_algorithm
    data = local_batches(rank, world_size, steps=3)
    inits_after_eval = None
    for step, (x, y) in enumerate(data):
        if step == 1 and rank == 0:
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
            inits_after_eval = impl.inits
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return dict(counts=impl.counts, inits=impl.inits, inits_after_eval=inits_after_eval)


def lifetime(rank: int, world_size: int) -> dict:
    """A model wrapped with a Bagua-interface algorithm, trained, then dropped: nothing keeps its
    algorithm or parameters alive, and its name's backend is a new one."""
    import gc
    import weakref

    from functional_bagua.compat.backend import get_backend

    model = make_model("shapes", DTYPE, seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    model._bagua_module_name = "dropped"
    model.with_bagua([opt], Centralized())
    train(model, opt, local_batches(rank, world_size, steps=1))
    engine = vars(model)["_bagua_engine"]
    refs = [weakref.ref(engine.bagua_algorithm), weakref.ref(next(model.parameters())), weakref.ref(engine)]
    del model, opt, engine
    gc.collect()
    return dict(alive=[r() is not None for r in refs], buckets=len(get_backend("dropped").buckets))
