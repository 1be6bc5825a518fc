"""Fusion: run any transform over flat buffers, one kernel per group instead of one per tensor.

``fuse(tx, layout)`` is ``tx`` applied to the flat buffers of ``layout`` (:mod:`functional_bagua.flat`)::

    layout = fb.FlatLayout.of(params)
    flat_params = layout.flatten(params)                  # once
    fused = fb.fuse(fb.adamw(1e-3), layout)
    state = fused.init(flat_params)                       # state.mu == {"float32@cpu": buffer}
    updates, state = fused.update(flat_grads, state, flat_params)
    flat_params = fb.apply_updates(flat_params, updates)
    layout.unflatten(flat_params)                         # named views, for functional_call

Elementwise math does not care where one tensor ends and the next begins, so on a flat buffer it
gives the same numbers as per tensor, with one kernel per group. Transforms whose rule is *per
tensor* (trust ratios, factored moments, Newton-Schulz, shape factors: ``per_tensor=True`` in
:func:`~functional_bagua.leafwise`) run their rule on each segment's view while a fused update
is active, so fused LAMB, LARS, Adafactor and Muon keep their per-parameter math (the trust ratio
of LAMB/LARS takes all segment norms in one op, :mod:`functional_bagua.segments`). Wrappers that
route by parameter name (``masked``, ``partition``) cannot see names in a flat buffer and raise
instead of guessing. Step counts are kept once per buffer, so every tensor of a fused group must
get a gradient at every step (flat gradients always do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from functional_bagua import kernels, tree
from functional_bagua.base import GradientTransformation, OptState, apply_updates
from functional_bagua.compiling import compile_own
from functional_bagua.flat import FlatLayout
from functional_bagua.layout_context import run_on_flat_buffers

if TYPE_CHECKING:
    from functional_bagua.distributed.whole_tensors import OwnerPlan


def fuse(tx: GradientTransformation, layout: FlatLayout) -> GradientTransformation:
    """``tx`` over the flat buffers of ``layout`` (module docstring). ``init`` and ``update`` take
    flat buffers (``{key: 1-D tensor}``) and check them against the layout.

    Args:
        tx: the transform to run over the flat buffers (a TypeError if not a ``GradientTransformation``).
        layout: the :class:`~functional_bagua.FlatLayout` of the parameter tree, from
            ``FlatLayout.of(params)`` (a TypeError for anything else).

    Returns:
        A :class:`~functional_bagua.GradientTransformation` whose state is ``tx``'s state over the flat
        buffers; its ``update`` takes ``params`` as flat buffers too, or ``None``.

    Example::

        layout = fb.FlatLayout.of(params)
        fused = fb.fuse(fb.adamw(1e-3), layout)
        state = fused.init(layout.flatten(params))
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"fuse: tx is {type(tx).__name__}, not a GradientTransformation")
    if not isinstance(layout, FlatLayout):
        raise TypeError(
            f"fuse: layout is {type(layout).__name__}, not a FlatLayout (make one with FlatLayout.of(params))"
        )

    # what the rules inside see: over DTensors' local shards, a stand-in that refuses per-tensor rules
    active = LocalShards(layout) if layout.on_shards else layout

    def init(params: dict[str, torch.Tensor]) -> OptState:
        layout.check(params)
        return run_on_flat_buffers(active, tx.init, params)

    def update(
        grads: dict[str, torch.Tensor], state: OptState, params: Optional[dict[str, torch.Tensor]] = None
    ) -> tuple[dict[str, torch.Tensor], OptState]:
        layout.check(grads)
        if params is not None:
            layout.check(params)
        return run_on_flat_buffers(active, tx.update, grads, state, params)

    return GradientTransformation(init, update)


class LocalShards:
    """Stands in for a layout over DTensors' local shards while a fused update runs: each rank
    holds a part of each tensor, so a rule that only sums over each tensor (a norm) asks for
    this rank's lengths and adds its sums up across the ranks
    (:func:`~functional_bagua.layout_context.summed_across_shards`); a rule that needs only the
    whole shapes (Muon's shape factor) asks for them; a stateless rule that needs whole tensors
    (Muon's orthogonalization) gets them gathered to an owner rank and its rows back
    (:mod:`functional_bagua.distributed.whole_tensors`); a rule that keeps state of whole tensors
    (a factored moment, a preconditioner) asks for the segments, and is refused. Buffers of plain
    or replicated tensors hold whole tensors and give their segments as a layout does."""

    is_shard = True  # transforms that reduce across tensors refuse too (layout_context.refuse_on_shards)

    def __init__(self, layout: FlatLayout) -> None:
        self.layout = layout
        self.plans: dict = {}  # key -> its OwnerPlan, None (a placement not gathered), or why it cannot be made
        for key in layout.keys:
            if _sharded_dim(layout, key) is not None:
                try:
                    self.plans[key] = _owner_plan(layout, key)
                except ValueError as error:  # shards of another split: refused only where whole tensors are asked
                    self.plans[key] = error

    def refusal(self, name: str, why: str) -> str:
        """The message of a transform refused here (``why`` it needs whole tensors)."""
        return (
            f"{name} cannot run inside fuse() over DTensors' local shards (an FSDP2 model's parameters): {why}, and "
            "each rank holds a part of each tensor. Wrap it, fb.fuse(fbd.on_owners(tx), layout) (each tensor "
            "gathered whole to an owner rank), or fuse an elementwise optimizer (sgd, adam, adamw, lion, ...), "
            "lamb, lars or muon."
        )

    def segments(self, key: str) -> tuple:
        """The segments of buffer ``key`` where it holds whole tensors; a NotImplementedError where
        it holds shards."""
        if key in self.plans:
            plan = self.plans[key]
            if plan is None:
                why = (
                    f"it needs whole tensors, gathered from Shard(0) shards only (buffer {key!r} is placed "
                    f"{self.layout.groups[key].placement})"
                )
            elif isinstance(plan, ValueError):
                why = f"it needs whole tensors, which cannot be gathered from these shards ({plan})"
            else:
                why = "it keeps state of whole tensors (only stateless rules get them gathered to an owner rank)"
            raise NotImplementedError(self.refusal("a per-tensor rule", f"{why}; buffer {key!r} holds shards"))
        return self.layout.segments(key)

    def owner_plan(self, key: str) -> Optional[OwnerPlan]:
        """How buffer ``key``'s tensors are gathered whole to their owners; ``None`` where the
        buffer holds whole tensors already, or where its placement is not gathered (then
        :meth:`segments` refuses); the ValueError of shards split otherwise than ``torch.chunk``."""
        plan = self.plans.get(key)
        if isinstance(plan, ValueError):
            raise plan
        return plan

    def named_shapes(self, key: str) -> list:
        """``(name, whole shape)`` of each tensor of buffer ``key`` (a DTensor's shape, not its
        local shard's)."""
        segments = self.layout.segments(key)
        shapes = self.layout.dtensor_shapes.get(key) or [seg.shape for seg in segments]
        return [(seg.name, shape) for seg, shape in zip(segments, shapes)]

    def segment_lengths(self, key: str) -> list:
        """The number of elements of this rank's part of each tensor of buffer ``key``."""
        return [seg.numel for seg in self.layout.groups[key].segments]

    def summed_across_shards(self, key: str, sums: torch.Tensor) -> torch.Tensor:
        """``sums`` over this rank's parts of the tensors of buffer ``key``, added up over the
        ranks of each mesh dimension the tensors are sharded along (one all-reduce each; a
        replicated dimension holds whole copies, added up nowhere)."""
        import torch.distributed._functional_collectives as funcol  # only where there are shards

        placement = self.layout.groups[key].placement
        if not placement:  # plain tensors beside the DTensors: whole here
            return sums
        mesh = self.layout.meshes[key]
        for dim, kind in enumerate(placement.split("-")):
            if kind == "partial":
                raise NotImplementedError(self.refusal("a sum over each tensor", "its parts are partial sums"))
            if kind.startswith("shard"):
                sums = funcol.wait_tensor(funcol.all_reduce(sums, "sum", mesh.get_group(dim)))
        return sums

    def shape_groups(self, key: str) -> tuple:
        if key in self.plans:
            raise NotImplementedError(self.refusal("a rule batching tensors by shape", "it needs whole tensors"))
        return self.layout.shape_groups(key)


def _sharded_dim(layout: FlatLayout, key: str) -> Optional[int]:
    """The mesh dimension along which buffer ``key``'s tensors are sharded (``None`` where each
    rank holds them whole: plain or replicated tensors); a NotImplementedError for placements
    whose whole tensors cannot be gathered (partial sums, more than one sharded dimension, a
    shard along another dimension than the first)."""
    kinds = [kind for kind in layout.groups[key].placement.split("-") if kind]
    sharded = [dim for dim, kind in enumerate(kinds) if kind != "replicate"]
    if not sharded:
        return None
    if len(sharded) > 1 or kinds[sharded[0]] != "shard0":
        return -1  # refused when a rule asks for whole tensors (LocalShards.owner_plan's caller)
    return sharded[0]


def _owner_plan(layout: FlatLayout, key: str) -> Optional[OwnerPlan]:
    """The :class:`~functional_bagua.distributed.whole_tensors.OwnerPlan` of buffer ``key``
    (``None`` where its placement is not one ``Shard(0)``, which stays refused)."""
    from functional_bagua.distributed.whole_tensors import OwnerPlan  # only where there are shards

    dim = _sharded_dim(layout, key)
    if dim is None or dim < 0:
        return None
    mesh = layout.meshes[key]
    return OwnerPlan(
        layout.dtensor_shapes[key],
        [seg.shape for seg in layout.segments(key)],
        mesh.get_local_rank(dim),
        mesh.size(dim),
        mesh.get_group(dim),
    )


KERNELS = ("auto", "torch", "compiled", "eager")


def fuse_inplace(
    tx: GradientTransformation, layout: FlatLayout, kernel: str = "auto", compile_options: Optional[dict] = None
) -> Callable[..., None]:
    """``step_(grads, state, params)``: one fused step that overwrites ``params`` and ``state``
    (made by ``step_.init(params)``, the same as ``fuse(tx, layout).init``) in place, for callers
    that give up their buffers ("donation"). ``kernel`` picks how:

    - ``"eager"``: the pure fused update, then a copy into the buffers: the same numbers as
      ``fuse(tx, layout)``, bit for bit.
    - ``"compiled"``: the same function through ``torch.compile(fullgraph=True)``; inductor turns
      the update and the copies into generated kernels that write into the buffers in place
      (numbers within float rounding), for every transform, the kernel aliases included.
    - ``"torch"``: torch's own fused kernel (``functional_bagua.kernels``), for ``sgd``,
      ``adam`` and ``adamw`` built with number hyperparameters: the numbers of
      ``torch.optim.*(fused=True)``. The fastest on CPU (benchmarks/RESULTS.md).
    - ``"auto"``: ``"torch"`` where it exists, else ``"compiled"``.

    Args:
        tx: the transform to step, as for :func:`fuse`.
        layout: the :class:`~functional_bagua.FlatLayout` of the parameter tree, as for :func:`fuse`.
        kernel: one of ``"auto"``, ``"torch"``, ``"compiled"``, ``"eager"`` (above); any other raises a
            ValueError, and so does ``"torch"`` for a ``tx`` that torch has no fused kernel for.
        compile_options: more keyword arguments of ``torch.compile`` for ``"compiled"``
            (``{"backend": "aot_eager"}``, ``{"mode": "max-autotune"}``); ``None`` for its defaults.

    Example::

        step_ = fb.fuse_inplace(tx, layout)
        state = step_.init(flat_params)
        step_(flat_grads, state, flat_params)       # flat_params and state now hold the new values
    """
    if kernel not in KERNELS:
        raise ValueError(f"fuse_inplace: kernel must be one of {KERNELS}, got {kernel!r}")
    fused = fuse(tx, layout)
    spec = kernels.spec_of(tx)
    if kernel == "torch" and spec is None:
        raise ValueError(
            "fuse_inplace: torch has a fused kernel only for sgd, adam and adamw built with number "
            "hyperparameters (not schedules); use kernel='compiled' or 'eager'"
        )
    if kernel == "auto":
        kernel = "torch" if spec is not None else "compiled"

    def pure_into_buffers(grads: dict[str, torch.Tensor], state: OptState, params: dict[str, torch.Tensor]) -> None:
        updates, new_state = fused.update(grads, state, params)
        tree.copy_into((params, state), (apply_updates(params, updates), new_state))

    if kernel == "torch" and spec is not None:  # spec exists: checked above

        def torch_kernel_step(grads: dict[str, torch.Tensor], state: OptState, params: dict[str, torch.Tensor]) -> None:
            layout.check(grads)
            layout.check(params)
            kernels.run(spec, grads, state, params)

        chosen: Callable[..., None] = torch_kernel_step
    elif kernel == "compiled":
        chosen = compile_own(pure_into_buffers, fullgraph=True, **(compile_options or {}))  # its own cache
    else:
        chosen = pure_into_buffers
    chosen.init = fused.init  # type: ignore[attr-defined]  # the state it steps
    return chosen
