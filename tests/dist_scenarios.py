"""Scenarios run on each gloo rank by dist_harness.run_ranks; test_distributed.py checks the results
against single-process references and torch's own distributed implementations."""

from __future__ import annotations

import os

import optree
import torch
from models import batches, loss_fn, make_model

import functional_bagua as fb
import functional_bagua.distributed as fbd

DTYPE = torch.float64
STEPS = 4
TINY_BUCKETS_MB = 0.0005  # 524 bytes: several buckets even for the small test model
LR = 0.1

TXS = {
    "sgd": lambda: fb.sgd(LR, momentum=0.9),
    "adamw": lambda: fb.adamw(1e-2, weight_decay=0.1),
}


# the newer first-order optimizers, wrapped unchanged by allreduce_gradients and (the elementwise
# ones) by shard: name -> (make, runs inside shard)
FIRST_ORDER = {
    "schedule_free_adamw": (lambda: fb.schedule_free_adamw(1e-2, warmup_steps=2, weight_decay=0.1), True),
    "adopt": (lambda: fb.adopt(1e-2, weight_decay=0.1, decouple=True), True),
    "ademamix": (lambda: fb.ademamix(1e-2, t_alpha_beta3=3), True),
    "prodigy": (lambda: fb.prodigy(weight_decay=0.1), False),
}


def global_batches():
    return batches(STEPS, DTYPE)


def local_batches(rank, world_size, seed=1, dtype=DTYPE):
    """This rank's slice of the global batch (the global loss is the mean of the ranks' losses)."""
    return [(x.chunk(world_size)[rank], y.chunk(world_size)[rank]) for x, y in batches(STEPS, dtype, seed=seed)]


def grads_of(model, params, x, y):
    return torch.func.grad(lambda ps: loss_fn(torch.func.functional_call(model, ps, (x,)), y))(params)


def train(tx, data, seed=0, update=None, trace=None, dtype=DTYPE):
    """Params and state after one ``tx`` step per batch; ``trace`` collects (params, grads) per step."""
    model = make_model("shapes", dtype, seed=seed)
    params = fb.params_of(model)
    state = tx.init(params)
    update = update or tx.update
    for x, y in data:
        grads = grads_of(model, params, x, y)
        if trace is not None:
            trace.append((params, grads))
        updates, state = update(grads, state, params)
        params = fb.apply_updates(params, updates)
    return params, state


def state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in fb.tree.flatten(state)[0] if isinstance(t, torch.Tensor))


# --- all-reduce and sharding: N ranks x batch b == 1 process x batch N*b --------------------------


def allreduce_sgd(rank, world_size):
    return train(fb.chain(fbd.allreduce_gradients(TINY_BUCKETS_MB), TXS["sgd"]()), local_batches(rank, world_size))[0]


def allreduce_adamw(rank, world_size):
    return train(fb.chain(fbd.allreduce_gradients(TINY_BUCKETS_MB), TXS["adamw"]()), local_batches(rank, world_size))[0]


def first_order_wrapped(rank, world_size):
    """Each of FIRST_ORDER after allreduce_gradients, and inside shard where it is elementwise."""
    data = local_batches(rank, world_size)
    out = {}
    for name, (make, shardable) in FIRST_ORDER.items():
        out[f"allreduce {name}"] = train(fb.chain(fbd.allreduce_gradients(TINY_BUCKETS_MB), make()), data)[0]
        if shardable:
            out[f"shard {name}"] = train(fbd.shard(make()), data)[0]
    return out


def shard_adamw(rank, world_size):
    params, state = train(fbd.shard(TXS["adamw"]()), local_batches(rank, world_size))
    return params, state_bytes(state)


LOW_PRECISION = {  # codec -> the inner transform of shard (float32 parameters; 8 bits in blocks of 32); the
    # codecs op by op: each rank would compile their kernels, whose numbers test_low_precision checks
    "bf16": lambda: fb.low_precision_state(fb.adamw(1e-2, weight_decay=0.1), "bf16", seed=5, compile_codecs=False),
    "8bit": lambda: fb.low_precision_state(
        fb.adamw(1e-2, weight_decay=0.1), "8bit", block_size=32, min_size=1, compile_codecs=False
    ),
}


def shard_low_precision(rank, world_size):
    """shard(low_precision_state(adamw)) in float32, per codec: the final params, this rank's
    gradients per step (for the single-process reference) and the encoded state's types."""
    out = {}
    for codec, make in LOW_PRECISION.items():
        trace = []
        data = local_batches(rank, world_size, dtype=torch.float32)
        params, state = train(fbd.shard(make()), data, trace=trace, dtype=torch.float32)
        encoded = (fb.Bfloat16Stored, fb.Signed8bit, fb.Unsigned8bit)
        leaves = optree.tree_leaves(state.inner.inner, is_leaf=lambda x: isinstance(x, encoded), none_is_leaf=True)
        stored = sorted({type(x).__name__ for x in leaves if isinstance(x, encoded)})
        out[codec] = (params, [grads for _, grads in trace], trace[0][0], stored)
    return out


def shard_lamb_refused(rank, world_size):
    return train(fbd.shard(fb.lamb(1e-2)), local_batches(rank, world_size))


def shard_prodigy_refused(rank, world_size):
    return train(fbd.shard(fb.prodigy()), local_batches(rank, world_size))


def shard_clip_refused(rank, world_size):
    return train(fbd.shard(fb.chain(fb.clip_by_global_norm(1.0), fb.sgd(LR))), local_batches(rank, world_size))


# --- torch's PostLocalSGDOptimizer on the same schedule ---------------------------------------------

PERIOD, WARMUP = 2, 1


def periodic_average(rank, world_size):
    # imported here: torch.distributed.optim costs every rank of the other scenarios a second
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    data = batches(6, DTYPE, seed=10 + rank)  # different data per rank: the models drift apart
    model = make_model("shapes", DTYPE)
    opt = PostLocalSGDOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
        PeriodicModelAverager(period=PERIOD, warmup_steps=WARMUP),
    )
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    expected = {name: p.detach() for name, p in model.named_parameters()}
    actual, _ = train(fb.chain(fb.sgd(LR, momentum=0.9), fbd.periodic_average(PERIOD, WARMUP)), data)
    local_only, _ = train(fb.sgd(LR, momentum=0.9), data)
    return expected, actual, local_only


# --- decentralized: each rank starts from its own weights ------------------------------------------


def decentralized(mode, interval):
    def scenario(rank, world_size):
        trace = []
        params, _ = train(
            fb.chain(fb.sgd(LR), fbd.decentralized(mode, interval)),
            batches(3, DTYPE, seed=20 + rank),
            seed=rank,
            trace=trace,
        )
        return trace, params

    return scenario


decentralized_shift_one = decentralized("shift_one", 1)
decentralized_all_every_2 = decentralized("all", 2)


# --- compression -------------------------------------------------------------------------------------


def compressed_mean(compression):
    def scenario(rank, world_size):
        gen = torch.Generator(device="cpu").manual_seed(100 + rank)  # the same numbers on every device
        params = {"a": torch.zeros(20, 25), "b": torch.zeros(537)}
        grads = {
            k: torch.randn(p.shape, generator=gen, device="cpu").to(p.device) * (rank + 1) for k, p in params.items()
        }
        tx = fbd.allreduce_gradients(bucket_cap_mb=0.001, compression=compression)
        return grads, tx.update(grads, tx.init(params), params)[0]

    return scenario


compressed_fp16 = compressed_mean("fp16")
compressed_bf16 = compressed_mean("bf16")
compressed_minmax_uint8 = compressed_mean("minmax_uint8")


# --- compiled: the same transforms inside torch.compile(fullgraph=True) -----------------------------


def compiled(make_tx):
    def scenario(rank, world_size):
        data = local_batches(rank, world_size)
        eager, _ = train(make_tx(), data)
        tx = make_tx()
        compiled_params, _ = train(tx, data, update=torch.compile(tx.update, fullgraph=True))
        return eager, compiled_params

    return scenario


compiled_allreduce_adamw = compiled(lambda: fb.chain(fbd.allreduce_gradients(TINY_BUCKETS_MB), TXS["adamw"]()))
compiled_allreduce_minmax_uint8 = compiled(
    lambda: fb.chain(fbd.allreduce_gradients(TINY_BUCKETS_MB, compression="minmax_uint8"), fb.sgd(LR))
)
compiled_shard_adamw = compiled(lambda: fbd.shard(TXS["adamw"]()))
compiled_shard_by_tensor_lamb = compiled(lambda: fbd.shard_by_tensor(fb.lamb(1e-2)))
compiled_periodic_average = compiled(lambda: fb.chain(fb.sgd(LR), fbd.periodic_average(2)))
compiled_shift_one = compiled(lambda: fb.chain(fb.sgd(LR), fbd.decentralized("shift_one")))


# --- bad input ------------------------------------------------------------------------------------


def mismatched_shapes(rank, world_size):
    params = {"w": torch.zeros(3, 4 + rank), "b": torch.zeros(3)}
    fbd.allreduce_gradients().init(params)


def dead_rank(rank, world_size):
    params = {"w": torch.zeros(3, 4)}
    tx = fbd.allreduce_gradients()
    state = tx.init(params)
    if rank == world_size - 1:
        os._exit(0)  # dies without a word, after init
    return tx.update({"w": torch.ones(3, 4)}, state, params)


# --- ranks that disagree: the same clear error on every rank, at init -------------------------------

MISMATCHED_SETTINGS = {
    "fp16_vs_bf16": (
        lambda: fbd.allreduce_gradients(compression="fp16"),
        lambda: fbd.allreduce_gradients(compression="bf16"),
    ),
    "none_vs_fp16": (lambda: fbd.allreduce_gradients(), lambda: fbd.allreduce_gradients(compression="fp16")),
    "none_vs_minmax": (lambda: fbd.allreduce_gradients(), lambda: fbd.allreduce_gradients(compression="minmax_uint8")),
    "mean_vs_sum": (lambda: fbd.allreduce_gradients(), lambda: fbd.allreduce_gradients(average=False)),
    "bucket_caps": (lambda: fbd.allreduce_gradients(25), lambda: fbd.allreduce_gradients(1)),
    "shard_mean_vs_sum": (lambda: fbd.shard(fb.sgd(LR)), lambda: fbd.shard(fb.sgd(LR), average=False)),
    "periods": (lambda: fbd.periodic_average(2), lambda: fbd.periodic_average(4)),
    "warmups": (lambda: fbd.periodic_average(2), lambda: fbd.periodic_average(2, warmup_steps=3)),
    "peer_modes": (lambda: fbd.decentralized("all"), lambda: fbd.decentralized("shift_one")),
    "intervals": (lambda: fbd.decentralized("all", 1), lambda: fbd.decentralized("all", 2)),
    "allreduce_vs_shard": (lambda: fbd.allreduce_gradients(), lambda: fbd.shard(fb.sgd(LR))),
    # the rest of a chain: an alias's numbers, an injected hyperparameter's value
    "chain_lr": (
        lambda: fb.chain(fbd.allreduce_gradients(), fb.adamw(1e-3)),
        lambda: fb.chain(fbd.allreduce_gradients(), fb.adamw(1e-2)),
    ),
    "chain_injected": (
        lambda: fb.chain(fbd.periodic_average(2), fb.inject_hyperparams(fb.sgd)(lr=0.1)),
        lambda: fb.chain(fbd.periodic_average(2), fb.inject_hyperparams(fb.sgd)(lr=0.2)),
    ),
}


def mismatched_settings(name):
    def scenario(rank, world_size):
        tx = MISMATCHED_SETTINGS[name][min(rank, 1)]()
        tx.init({"w": torch.ones(3, 4), "b": torch.ones(4)})  # a mismatch must raise here, before any update
        return "init passed"

    return scenario


for _name in MISMATCHED_SETTINGS:
    globals()[f"mismatched_{_name}"] = mismatched_settings(_name)


def seeded_per_rank(rank):
    return fb.params_of(make_model("shapes", DTYPE, seed=rank))


def different_values_allreduce(rank, world_size):
    fbd.allreduce_gradients().init(seeded_per_rank(rank))


def different_values_shard(rank, world_size):
    fbd.shard(fb.adamw()).init(seeded_per_rank(rank))


def different_values_broadcast_first(rank, world_size):
    """broadcast_params gives every rank rank 0's values; then init passes."""
    mine = seeded_per_rank(rank)
    params = fbd.broadcast_params(mine)
    fbd.allreduce_gradients().init(params)
    return mine, params


def shard_checkpoint_of_another_rank(rank, world_size):
    """Each rank saves its shard state, then loads its own (fine) and the other rank's (refused)."""
    tx = fbd.shard(TXS["adamw"]())
    _, state = train(tx, local_batches(rank, world_size))
    everyone = [None] * world_size
    torch.distributed.all_gather_object(everyone, fb.state_dict(state))
    params = fb.params_of(make_model("shapes", DTYPE))
    own = fb.load_state_dict(tx.init(params), everyone[rank])
    same = all(torch.equal(a, b) for a, b in zip(fb.state_dict(own).values(), fb.state_dict(state).values()))
    try:
        fb.load_state_dict(tx.init(params), everyone[(rank + 1) % world_size])
    except ValueError as e:
        return same, str(e)
    return same, None


def update_differs_from_init(rank, world_size):
    """Both ranks init on the same parameters; rank 1 then updates with a gradient tree of another
    shape. Rank 1 must raise before sending; rank 0, left waiting in the collective, fails once
    rank 1 exits (as with any dead rank)."""
    params = {"w": torch.zeros(3, 4), "b": torch.zeros(4)}
    tx = fbd.allreduce_gradients()
    state = tx.init(params)
    grads = {"w": torch.ones(3, 4), "b": torch.ones(4)}
    if rank == 1:
        params, grads = {**params, "b": torch.zeros(5)}, {**grads, "b": torch.ones(5)}
    return tx.update(grads, state, params)


def averaging_wrong_update(rank, world_size):
    """An update of another shape than its parameter reaches periodic_average directly."""
    params = {"w": torch.zeros(3, 4)}
    tx = fbd.periodic_average(1)
    return tx.update({"w": torch.ones(4)}, tx.init(params), params)


# --- make_train_step with the all-reduce during backward -------------------------------------------


def train_step_overlapped(rank, world_size):
    """make_train_step (eager) with chain(allreduce_gradients, adamw) and with the ByteGrad-like
    minmax_uint8 codec: parameters after each step with the all-reduce run during backward and
    after it; and whether the first buckets were launched before backward ended."""
    from functional_bagua import kernels
    from functional_bagua.distributed import reducer as reducer_module

    out = {}
    rule = fb.adamw(fb.schedules.constant(1e-2), weight_decay=0.1)  # a schedule: the update's own rule
    for name, compression, inner, donate in (
        ("plain", None, TXS["adamw"], False),  # torch's fused kernel (functional form) after the reduction
        ("donated", None, TXS["adamw"], True),  # the kernel in place
        ("minmax_uint8", "minmax_uint8", TXS["adamw"], False),
        ("rule", None, lambda: rule, False),
    ):
        for overlap in (True, False):
            model = make_model("norm", DTYPE, seed=0)  # with BatchNorm buffers
            tx = fb.chain(fbd.allreduce_gradients(TINY_BUCKETS_MB, compression=compression), inner())
            step = fb.make_train_step(model, loss_fn, tx, compile=False, overlap=overlap, donate=donate)
            params = fb.params_of(model)
            state = tx.init(params)
            launches: list = []
            original = reducer_module.GradientReducer._launch

            def spy(self, bucket, launches=launches, original=original):
                launches.append(self._in_backward)
                return original(self, bucket)

            reducer_module.GradientReducer._launch = spy
            kernel_calls: list = []
            run_pure = kernels.run_pure
            kernels.run_pure = lambda *args, calls=kernel_calls, run_pure=run_pure: calls.append(1) or run_pure(*args)
            try:
                trace = []
                for batch in local_batches(rank, world_size):
                    params, state, loss = step(params, state, batch)
                    trace.append(
                        (
                            {k: v.clone() for k, v in params.items()},
                            loss,
                            {k: b.clone() for k, b in model.named_buffers()},
                        )
                    )
            finally:
                reducer_module.GradientReducer._launch = original
                kernels.run_pure = run_pure
            out[f"{name}/{'overlap' if overlap else 'after'}"] = dict(
                trace=trace, launched_in_backward=launches, kernel_steps=len(kernel_calls)
            )
    return out


def compiled_train_step_overlapped(rank, world_size):
    """make_train_step(compile=True) on a parameter tree with chain(allreduce_gradients, adamw),
    with and without the communication reordering: parameters and losses per step, and how many
    matrix products of backward the generated code runs between launching the first all-reduce
    and waiting for it."""
    from torch._inductor.utils import run_and_get_code

    out = {}
    for overlap in (True, False):
        model = make_model("deep", DTYPE, seed=0)
        tx = fb.chain(fbd.allreduce_gradients(TINY_BUCKETS_MB), TXS["adamw"]())
        step = fb.make_train_step(model, loss_fn, tx, compile=True, overlap=overlap)
        params = fb.params_of(model)
        state = tx.init(params)
        trace, code = [], ""
        for i, batch in enumerate(local_batches(rank, world_size)):
            if i == 0:
                (params, state, loss), sources = run_and_get_code(step, params, state, batch)
                code = "".join(sources)
                code = code[code.index("def call(") :]
            else:
                params, state, loss = step(params, state, batch)
            trace.append(({k: v.clone() for k, v in params.items()}, loss))
        launched = code.find("_c10d_functional.all_reduce")
        awaited = code.find("_c10d_functional.wait_tensor")
        out["overlap" if overlap else "after"] = dict(
            trace=trace, mm_while_reducing=code[launched:awaited].count("extern_kernels.mm(") if launched >= 0 else -1
        )
    return out


# --- torch.distributed.checkpoint: a shard() state saved on some ranks, loaded on others -----------

DCP_STEPS = 3


def dcp_tx():
    """shard(adamw), or shard_by_tensor(adamw) where $FB_DCP_SHARD says "by tensor"."""
    by_tensor = os.environ.get("FB_DCP_SHARD") == "by tensor"
    return (fbd.shard_by_tensor if by_tensor else fbd.shard)(TXS["adamw"]())


def dcp_train(params, state, tx, data, model):
    for x, y in data:
        updates, state = tx.update(grads_of(model, params, x, y), state, params)
        params = fb.apply_updates(params, updates)
    return params, state


def dcp_save_sharded(rank, world_size):
    """DCP_STEPS steps of shard(adamw), then params and state saved with DCP to $FB_DCP_DIR."""
    import torch.distributed.checkpoint as dcp

    model = make_model("shapes", DTYPE, seed=0)
    params, tx = fb.params_of(model), dcp_tx()
    params, state = dcp_train(params, tx.init(params), tx, local_batches(rank, world_size)[:DCP_STEPS], model)
    dcp.save(
        {"params": params, "opt": fbd.distributed_state_dict(state, params)}, checkpoint_id=os.environ["FB_DCP_DIR"]
    )
    return {k: v.clone() for k, v in params.items()}


def dcp_resume_sharded(rank, world_size):
    """Params and shard(adamw) state loaded with DCP from $FB_DCP_DIR (saved on another number of
    ranks), then the remaining steps: the final params."""
    import torch.distributed.checkpoint as dcp

    model = make_model("shapes", DTYPE, seed=5)  # other values: everything comes from the checkpoint
    params, tx = fb.params_of(model), dcp_tx()
    params = {k: torch.zeros_like(v) for k, v in params.items()}
    state = tx.init(params)
    dcp.load(
        {"params": params, "opt": fbd.distributed_state_dict(state, params)}, checkpoint_id=os.environ["FB_DCP_DIR"]
    )
    params, state = dcp_train(params, state, tx, local_batches(rank, world_size)[DCP_STEPS:], model)
    return {k: v.clone() for k, v in params.items()}


def optimizer_under_ddp(rank, world_size):
    """torch DDP with fb.Optimizer(fb.adamw) and with torch.optim.AdamW, the same steps and a
    scheduler: the parameters of each at the end."""
    from models import default_dtype

    out = {}
    for name in ("fb", "torch"):
        with default_dtype(DTYPE):
            model = torch.nn.parallel.DistributedDataParallel(make_model("shapes", DTYPE, seed=0))
            if name == "fb":
                opt = fb.Optimizer(model.parameters(), fb.adamw, lr=1e-2, weight_decay=0.1)
            else:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            for x, y in local_batches(rank, world_size):
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
                sched.step()
        out[name] = {k: v.detach().clone() for k, v in model.module.named_parameters()}
    return out
