"""Run scenarios on N gloo ranks (separate processes, loopback only) and collect their results.

    results = run_ranks(2, ["allreduce_sgd", "shard_adamw"])    # results[rank][name]

Each scenario is a function ``name(rank, world_size)`` in :mod:`dist_scenarios` (or the module
``run_ranks`` names). With ``device="cuda"`` every rank makes the GPU its default device (ranks
share the one GPU) and joins a process group of ``backend``: NCCL at world size 1 (NCCL refuses
two ranks on one device), gloo's CUDA-tensor collectives for more. Its return value
(tensors allowed) comes back through ``torch.save``. An exception in a scenario comes back as
``ScenarioError`` (its type name, message and the seconds it took). Every wait has a timeout, so a
hang fails the test instead of the suite.
"""

from __future__ import annotations

import datetime
import importlib
import os
import socket
import tempfile
import time
from typing import NamedTuple

import torch
import torch.multiprocessing as mp

PROCESS_GROUP_TIMEOUT_S = 20


class ScenarioError(NamedTuple):
    type: str
    message: str
    seconds: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world_size: int, port: int, names: list, out_dir: str, module: str, init: bool, device: str, backend: str
) -> None:
    import torch.distributed as dist

    scenarios = importlib.import_module(module)
    os.environ.update(  # what torchrun sets
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    if torch.device(device).type == "cuda":
        from devices import use_device

        torch.cuda.set_device(0)
        use_device(torch.device(device))
    if init:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)
        )
    results = {}
    for name in names:
        start = time.monotonic()
        _progress(f"{module}.{name} rank {rank}/{world_size} {device} {backend}: started")
        try:
            results[name] = getattr(scenarios, name)(rank, world_size)
        except Exception as e:  # reported to the test, which decides
            results[name] = ScenarioError(type(e).__name__, str(e), time.monotonic() - start)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        status = "raised" if isinstance(results[name], ScenarioError) else "done"
        _progress(
            f"{module}.{name} rank {rank}/{world_size} {device} {backend}: {status} in {time.monotonic() - start:.1f} s"
        )
    if dist.is_initialized():
        dist.destroy_process_group()


def _progress(line: str) -> None:
    """With ``FB_DIST_PROGRESS=FILE``, ``line`` is appended to FILE as it happens (which scenario a
    hung run was in; the prepared GPU run keeps the file)."""
    path = os.environ.get("FB_DIST_PROGRESS")
    if path:
        with open(path, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {line}\n")


# Imported once by the fork server: each CPU rank is then forked from a process that has them,
# instead of importing torch (about 2 s of CPU) again in every spawned interpreter.
PRELOADED = ["torch", "torch.distributed", "functional_bagua", "functional_bagua.distributed"]
_FORKSERVER = None


def _context(fresh_interpreter: bool):  # noqa: ANN202
    """``spawn`` where a rank must start from a fresh interpreter (CUDA), else a fork server that
    has preloaded :data:`PRELOADED` (started at its first use, shared by every later run)."""
    global _FORKSERVER
    if fresh_interpreter:
        return mp.get_context("spawn")
    if _FORKSERVER is None:
        _FORKSERVER = mp.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(PRELOADED)
    return _FORKSERVER


def _in_environment(environment: dict, target, *args) -> None:  # noqa: ANN001
    """``target(*args)`` with the environment the test had when it started the ranks (a forked
    rank would otherwise see the fork server's, from when it started)."""
    os.environ.clear()
    os.environ.update(environment)
    target(*args)


def _spawn_and_join(  # noqa: ANN001
    target, args_per_process: list, timeout_s: float, names: list, fresh_interpreter: bool = False
) -> None:
    """Start one process per argument tuple (:func:`_context`) and join them all by ``timeout_s``; a
    process still running then is killed and reported as a TimeoutError (a hang fails fast)."""
    ctx = _context(fresh_interpreter)
    environment = dict(os.environ)
    procs = [ctx.Process(target=_in_environment, args=(environment, target, *args)) for args in args_per_process]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    if hung:
        raise TimeoutError(f"processes {hung} still running after {timeout_s} s: {names}")


def run_ranks(
    world_size: int,
    names: list,
    timeout_s: float = 300,
    module: str = "dist_scenarios",
    init: bool = True,
    device: str = "cpu",
    backend: str = "gloo",
) -> list[dict]:
    """``results[rank][name]`` of each scenario of ``module`` run on ``world_size`` ranks, in order.
    With ``init=False`` the scenarios initialize torch.distributed themselves (torchrun's variables
    are set either way). ``device`` becomes each rank's default device; ``backend`` is
    ``init_process_group``'s (``"cpu:gloo,cuda:nccl"`` for NCCL with CPU object collectives)."""
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        _spawn_and_join(
            _entry,
            [(r, world_size, port, names, out_dir, module, init, device, backend) for r in range(world_size)],
            timeout_s,
            names,
            fresh_interpreter=torch.device(device).type != "cpu",
        )
        results = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pt")
            results.append(torch.load(path, weights_only=False) if os.path.exists(path) else {})
        return results


def _rpc_entry(rank: int, world_size: int, port: int, names: list, out_dir: str, module: str) -> None:
    import torch.distributed.rpc as rpc

    scenarios = importlib.import_module(module)
    torch.set_num_threads(1)
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=PROCESS_GROUP_TIMEOUT_S, _transports=["uv"]
    )
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    results = {}
    if rank == 0:  # the client; the other workers own parameters and serve its calls
        for name in names:
            start = time.monotonic()
            try:
                results[name] = getattr(scenarios, name)(world_size)
            except Exception as e:  # reported to the test, which decides
                results[name] = ScenarioError(type(e).__name__, str(e), time.monotonic() - start)
        torch.save(results, os.path.join(out_dir, "worker0.pt"))
    rpc.shutdown()


def run_rpc(world_size: int, names: list, module: str, timeout_s: float = 300) -> dict:
    """``results[name]`` of each scenario ``name(world_size)`` of ``module``, run on worker 0 of
    ``world_size`` RPC workers (TensorPipe on loopback); the others serve."""
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        _spawn_and_join(
            _rpc_entry, [(r, world_size, port, names, out_dir, module) for r in range(world_size)], timeout_s, names
        )
        path = os.path.join(out_dir, "worker0.pt")
        return torch.load(path, weights_only=False) if os.path.exists(path) else {}
