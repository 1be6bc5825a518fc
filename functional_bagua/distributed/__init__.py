"""Data-parallel training as composable transforms over torch.distributed (gloo, NCCL).

    import functional_bagua.distributed as fbd

    tx = fb.chain(fbd.allreduce_gradients(bucket_cap_mb=25), fb.clip_by_global_norm(1.0), fb.adamw(1e-3))
    tx = fbd.shard(fb.adamw(1e-3))                                         # ZeRO: state sharded
    tx = fbd.shard_by_tensor(fb.soap())                                    # ZeRO by whole tensors
    tx = fb.fuse(fbd.on_owners(fb.soap()), fb.FlatLayout.of(fsdp2_params))  # FSDP2: whole on owners
    tx = fb.chain(fb.sgd(0.1), fbd.periodic_average(period=4))             # local SGD
    tx = fb.chain(fb.sgd(0.1), fbd.decentralized("shift_one"))             # decentralized SGD

Each transform checks at ``init`` that a process group exists, that every rank built it with the
same settings and holds the same parameters (and, for ``allreduce_gradients`` and ``shard``, the
same values: ``broadcast_params`` gives every rank rank 0's), and checks at ``update`` that it sends
what ``init`` checked; a mismatch is a ValueError, not a hang. The collectives are torch's
functional ones, so each transform runs eagerly and inside a compiled step.
"""

from functional_bagua.distributed.allreduce import allreduce_gradients
from functional_bagua.distributed.averaging import (
    AveragingState,
    decentralized,
    peer_of,
    periodic_average,
)
from functional_bagua.distributed.buckets import assign_buckets
from functional_bagua.distributed.checkpoint import distributed_state_dict
from functional_bagua.distributed.compression import COMPRESSIONS, dequantize, quantize
from functional_bagua.distributed.process_group import broadcast_params
from functional_bagua.distributed.reducer import GradientReducer
from functional_bagua.distributed.sharding import ShardState, shard
from functional_bagua.distributed.tensor_sharding import TensorShardState, shard_by_tensor
from functional_bagua.distributed.whole_tensors import OnOwnersState, on_owners

__all__ = [
    "allreduce_gradients",
    "shard",
    "ShardState",
    "shard_by_tensor",
    "TensorShardState",
    "on_owners",
    "OnOwnersState",
    "periodic_average",
    "decentralized",
    "AveragingState",
    "peer_of",
    "assign_buckets",
    "COMPRESSIONS",
    "quantize",
    "dequantize",
    "broadcast_params",
    "GradientReducer",
    "distributed_state_dict",
]
