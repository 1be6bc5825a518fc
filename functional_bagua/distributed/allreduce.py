"""Data-parallel gradient averaging as a transform: the first link of a distributed chain.

With ``n`` ranks, each computing ``g_r`` on its own part of the batch::

    u = (1/n) * sum_r g_r            (average=True; the sum with average=False)

which, for a loss that is a mean over the batch, is the gradient of the whole global batch.
Gradients travel in DDP's buckets (:mod:`~functional_bagua.distributed.buckets`): reverse
parameter order, DDP's sizes (1 MiB first, 25 MiB after) or ``bucket_cap_mb`` MiB each, one flat
buffer per bucket, all launched before the first is awaited; ``compression`` as in :mod:`~functional_bagua.distributed.compression`.

Example (under ``torchrun --nproc-per-node 2``)::

    tx = fb.chain(fbd.allreduce_gradients(), fb.clip_by_global_norm(1.0), fb.adamw(1e-3))
"""

from __future__ import annotations

import functools
from typing import Optional

import optree
import torch
import torch.distributed as dist

from functional_bagua import checks, tree
from functional_bagua.base import EmptyState, GradientTransformation
from functional_bagua.distributed import buckets as bucketing
from functional_bagua.distributed import compression as codecs
from functional_bagua.distributed.process_group import Agreement, Group, resolve
from functional_bagua.tree import PyTree

NAME = "allreduce_gradients"


def allreduce_gradients(
    bucket_cap_mb: Optional[float] = None,
    average: bool = True,
    compression: Optional[str] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> GradientTransformation:
    """Average (or sum) the gradients over the ranks of ``group`` (module docstring).

    ``init`` checks that every rank built this transform with the same settings and holds the
    same parameters, values included (replicas must start equal; see
    :func:`~functional_bagua.distributed.broadcast_params`); ``update`` checks that it sends the
    tensors ``init`` checked. A ``None`` gradient (a parameter this rank did not use) is sent as
    zeros, as DDP does with unused parameters, so that every rank sends the same buckets;
    ``update`` then needs ``params`` for its shape.

    Args:
        bucket_cap_mb: the bucket size in MiB (a bucket closes once it reaches it, as in DDP); must
            be positive. ``None`` (default) for DDP's defaults: the first bucket 1 MiB, the others 25.
        average: ``True`` for the mean over the ranks, ``False`` for the sum.
        compression: one of ``functional_bagua.distributed.COMPRESSIONS``: ``None``, ``"fp16"``,
            ``"bf16"`` or ``"minmax_uint8"``; with one, complex gradients are refused.
        group: the process group; ``None`` for the default group (looked up at each ``init`` and
            ``update``).

    Returns:
        A :class:`~functional_bagua.GradientTransformation` whose state is an ``EmptyState``.

    Example::

        tx = fb.chain(fbd.allreduce_gradients(compression="bf16"), fb.adamw(1e-3))
        params = fbd.broadcast_params(fb.params_of(model))
        state = tx.init(params)
    """
    caps = bucketing.bucket_caps(bucket_cap_mb, NAME)
    codecs.check_compression(compression)
    agreement = Agreement(
        NAME, dict(bucket_cap_mb=bucket_cap_mb, average=average, compression=compression), same_values=True
    )

    def init(params: PyTree) -> EmptyState:
        agreement.init(params, resolve(group, NAME))
        return EmptyState()

    def update(grads: PyTree, state: EmptyState, params: Optional[PyTree] = None) -> tuple[PyTree, EmptyState]:
        g = resolve(group, NAME)
        leaves, spec = tree.flatten(grads)
        leaves = _dense_leaves(leaves, spec, params, complex_ok=compression is None)
        agreement.check(leaves)
        return spec.unflatten(reduce_in_buckets(leaves, caps, g, average, compression)), state

    update.agree_on_chain = functools.partial(agreement.agree_on_chain, group=group)  # type: ignore[attr-defined]
    # what make_train_step needs to run this reduction during backward instead (GradientReducer)
    update.reducer_settings = dict(  # type: ignore[attr-defined]
        bucket_cap_mb=bucket_cap_mb, average=average, compression=compression, group=group
    )
    return GradientTransformation(init, update)


def _dense_leaves(leaves: list, spec: optree.PyTreeSpec, params: Optional[PyTree], complex_ok: bool) -> list:
    """The gradient leaves with ``None`` replaced by zeros shaped like the parameter; an error
    naming the parameter for a gradient that is sparse, not floating-point (nor complex, where
    ``complex_ok``: the compressions cast to real dtypes) or not shaped like its parameter."""
    param_leaves = tree.leaves_matching(spec, params, "params", "grads") if params is not None else [None] * len(leaves)
    dense = []
    for i, (g, p) in enumerate(zip(leaves, param_leaves)):
        if g is None:
            if p is None:
                raise ValueError(
                    f"{NAME}: gradient of {tree.leaf_names(spec)[i]!r} is None; pass params so that it can be sent as zeros"
                )
            g = torch.zeros_like(p)
        checks.check_grad(g, p, functools.partial(tree.leaf_name, spec, i), NAME, complex_ok=complex_ok)
        dense.append(g)
    return dense


def reduce_in_buckets(
    tensors: list[torch.Tensor],
    caps: tuple[int, int],
    group: Group,
    average: bool,
    compression: Optional[str],
) -> list[torch.Tensor]:
    """Each tensor reduced over the ranks (:func:`~functional_bagua.distributed.compression.all_reduce`),
    through DDP's buckets, every bucket launched before any is awaited: one result
    per tensor, in its shape.

    Args:
        tensors: dense tensors, every rank holding the same shapes and dtypes in the same order.
        caps: ``(first, rest)``, the bucket sizes in bytes
            (:func:`~functional_bagua.distributed.buckets.bucket_caps`).
        group: the resolved process group.
        average: the mean over the ranks (``True``) or the sum.
        compression: as for :func:`~functional_bagua.distributed.compression.all_reduce`.
    """
    assignment = bucketing.assign_buckets(tensors, caps[1], caps[0])
    flat = [bucketing.pack(tensors, bucket) for bucket in assignment]
    reduced = codecs.all_reduce(flat, group, average, compression)
    out: list[torch.Tensor] = list(tensors)
    for bucket, buffer in zip(assignment, reduced):
        for i, piece in zip(bucket, bucketing.unpack(buffer, tensors, bucket)):
            out[i] = piece
    return out
