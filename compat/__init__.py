"""functional_bagua.compat: legacy stateful APIs (Bagua, torch.distributed.optim) rebuilt on the
functional core. Installed from the repository's ``compat/`` folder as ``functional_bagua.compat``.

A Bagua script runs after replacing ``import bagua.torch_api as bagua`` with
``import functional_bagua.compat as bagua``; the module layout mirrors ``bagua.torch_api``:

- ``init_process_group``, ``get_rank``, ``get_world_size``, ``get_local_rank``, ``get_local_size``,
  the collectives and ``ReduceOp`` (:mod:`~functional_bagua.compat.communication`);
- ``model.with_bagua(optimizers, algorithm)`` on every ``torch.nn.Module`` once this package is
  imported (:mod:`~functional_bagua.compat.bagua_module`), and Bagua's tensor methods
  (``ensure_bagua_tensor``...) on every ``torch.Tensor`` (:mod:`~functional_bagua.compat.tensor`),
  for algorithms written to Bagua's interface (buckets and their operations:
  :mod:`~functional_bagua.compat.bucket`);
- ``algorithms`` (gradient_allreduce, bytegrad, decentralized, q_adam, async_model_average),
  ``data_parallel.DistributedDataParallel``, ``contrib.fuse_optimizer``;
- :func:`~functional_bagua.compat.fuse.fuse_optimizer`, :func:`~functional_bagua.compat.fuse.fuse_step`,
  :func:`~functional_bagua.compat.fuse.is_fused_optimizer`, :func:`~functional_bagua.compat.fuse.fused_steps`:
  Bagua's fused optimizer for any ``torch.optim.Optimizer`` (:mod:`functional_bagua.compat.fuse`).
"""

import torch as _torch

from functional_bagua.compat import algorithms, communication, contrib, data_parallel, optim, tensor, utils
from functional_bagua.compat.bagua_module import BaguaDistributedDataParallel, BaguaModule, patch_torch_module
from functional_bagua.compat.communication import (
    BaguaProcessGroup,
    ReduceOp,
    allgather,
    allgather_inplace,
    allreduce,
    allreduce_inplace,
    alltoall,
    alltoall_inplace,
    alltoall_v,
    alltoall_v_inplace,
    barrier,
    broadcast,
    gather,
    gather_inplace,
    get_backend,
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
    recv,
    reduce,
    reduce_inplace,
    reduce_scatter,
    reduce_scatter_inplace,
    scatter,
    scatter_inplace,
    send,
)
from functional_bagua.compat.fuse import (
    fuse_optimizer,
    fuse_step,
    fused_steps,
    is_fused_optimizer,
)
from functional_bagua.compat.tensor import BaguaTensor

patch_torch_module()
communication.patch_torch_process_group()
tensor.patch_torch_tensor()

version = _torch.__version__  # Bagua's: the torch version it runs on

__all__ = [
    "fuse_optimizer",
    "fuse_step",
    "fused_steps",
    "is_fused_optimizer",
    "init_process_group",
    "is_initialized",
    "new_group",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "get_local_size",
    "BaguaProcessGroup",
    "BaguaDistributedDataParallel",
    "BaguaModule",
    "BaguaTensor",
    "ReduceOp",
    "get_backend",
    "send",
    "recv",
    "broadcast",
    "reduce",
    "reduce_inplace",
    "allreduce",
    "allreduce_inplace",
    "allgather",
    "allgather_inplace",
    "gather",
    "gather_inplace",
    "scatter",
    "scatter_inplace",
    "reduce_scatter",
    "reduce_scatter_inplace",
    "alltoall",
    "alltoall_inplace",
    "alltoall_v",
    "alltoall_v_inplace",
    "barrier",
    "algorithms",
    "communication",
    "contrib",
    "data_parallel",
    "optim",
    "tensor",
    "utils",
]
