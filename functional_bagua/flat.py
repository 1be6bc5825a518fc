"""Flat buffers: every tensor of one (dtype, device) group as a view into one contiguous buffer.

A :class:`FlatLayout` records, once, where each named tensor lives::

    layout = fb.FlatLayout.of(params)        # groups by (dtype, device), keeps the tree's order
    flat = layout.flatten(params)            # {"float32@cpu": 1-D buffer, ...}: one copy, once
    views = layout.unflatten(flat)           # the params tree again, each leaf a view (no copy)

``FlatLayout.of(params, max_buffer_mb=16)`` cuts a (dtype, device) group into several buffers of
at most that size (``"float32@cpu"``, ``"float32@cpu/1"``, ...; a tensor larger than the cap gets
a buffer of its own). A pure update writes new buffers every step; glibc's malloc maps blocks of
32 MiB and more afresh each time, so they fault in page by page, while smaller ones can be reused
when the process keeps its freed memory (``MALLOC_MMAP_THRESHOLD_=33554432`` and
``MALLOC_TRIM_THRESHOLD_=2147483647`` in the environment, or jemalloc/tcmalloc): benchmarks/RESULTS.md.

Parameters sharded by FSDP2 (``fully_shard``) or otherwise held as DTensors are laid out by their
local shards: each rank's buffers hold its own shards only (``"float32@cpu:shard0"``, a group per
dtype, device and placement), so the optimizer state of a fused update stays sharded, and
:meth:`FlatLayout.unflatten` gives the local shards back (write them into ``p.to_local()``).
Elementwise transforms run on them as on whole tensors, and so do rules that only need sums
over each tensor (LAMB's and LARS's norms: this rank's parts summed across the ranks) or its
shape (Muon's shape factor); a stateless rule that needs the whole tensor (Muon's
orthogonalization) gets it gathered to one rank (:mod:`functional_bagua.distributed.whole_tensors`);
a rule that keeps state of the whole tensor (a factored moment, a preconditioner) refuses inside
:func:`~functional_bagua.fuse` with a NotImplementedError.

Flat buffers are a pytree too (a dict by group key), so any transform runs over them: elementwise
math becomes one kernel per group whatever the number of tensors (see :mod:`functional_bagua.fusion`).
:func:`flatten_parameters` re-points parameters into flat buffers, as Bagua's ``do_flatten`` does,
and :func:`flatten_module` does it for a module's parameters and gradients, so that ``backward()``
writes every gradient into one buffer. Tensors that already lie back to back are one flat buffer
without a copy: :func:`span` views them as one, :func:`split_like` is its inverse.
"""

from __future__ import annotations

import math
import sys
from typing import Any, NamedTuple, Optional, Sequence

import optree
import torch

from functional_bagua import tree


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor. Asked of ``torch.distributed.tensor`` only once something has
    imported it (FSDP2, DTensor's users): until then nothing can be a DTensor, and importing it
    here would cost every process that never uses one (half a second of each spawned rank).

    Args:
        t: any object.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


class Segment(NamedTuple):
    """One tensor of the tree: its name, where it starts in its group's buffer, its shape."""

    name: str
    offset: int
    shape: tuple

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def of(self, buffer: torch.Tensor) -> torch.Tensor:
        """This tensor's view into ``buffer`` (the group's flat buffer, or one like it).

        Args:
            buffer: a 1-D tensor laid out as this segment's group (e.g. a flat parameter, gradient
                or state buffer).
        """
        return buffer[self.offset : self.offset + self.numel].view(self.shape)


class Rows(NamedTuple):
    """Where equal-sized tensors lie in a flat buffer: ``number`` tensors of ``numel`` elements,
    one after the other from ``start``, or (``offsets`` not ``None``) each at its offset."""

    start: int
    number: int
    numel: int
    offsets: Optional[tuple]


def by_shape(segments: Sequence[Segment]) -> tuple:
    """The non-empty ``segments`` grouped by shape: ``(shape, Rows)`` per shape, in the order
    each first occurs, each group's tensors in buffer order.

    Args:
        segments: the segments of one flat buffer.
    """
    offsets_of: dict[tuple, list] = {}
    for seg in segments:
        if seg.numel:
            offsets_of.setdefault(tuple(seg.shape), []).append(seg.offset)
    grouped = []
    for shape, offsets in offsets_of.items():
        numel = math.prod(shape)
        apart = any(offset != offsets[0] + j * numel for j, offset in enumerate(offsets))
        grouped.append((shape, Rows(offsets[0], len(offsets), numel, tuple(offsets) if apart else None)))
    return tuple(grouped)


class FlatGroup(NamedTuple):
    """The tensors sharing one buffer: ``key`` (``"float32@cpu"``), dtype, device, segments, size,
    and the placement of the DTensors whose local shards it holds (``""`` for plain tensors)."""

    key: str
    dtype: torch.dtype
    device: torch.device
    segments: tuple
    numel: int
    placement: str = ""


def group_key(dtype: torch.dtype, device: torch.device, part: int = 0, placement: str = "") -> str:
    """The key of the flat buffer that holds the tensors of ``dtype`` on ``device``, e.g. ``"float32@cpu"``;
    ``"float32@cpu/1"`` for the second buffer of a group cut by a size cap; ``"float32@cpu:shard0"``
    for the local shards of DTensors placed ``Shard(0)``.

    Args:
        dtype: the tensors' dtype (written without its ``torch.`` prefix).
        device: the tensors' device (written as ``str(device)``, e.g. ``cpu`` or ``cuda:0``).
        part: which buffer of the group (0 for the first, whose key has no suffix).
        placement: the DTensors' placement (:func:`placement_of`), ``""`` for plain tensors.
    """
    base = f"{str(dtype).removeprefix('torch.')}@{device}" + (f":{placement}" if placement else "")
    return f"{base}/{part}" if part else base


def placement_of(t: torch.Tensor) -> str:
    """A DTensor's placements on its mesh as a short name (``Shard(0)`` is ``"shard0"``; one
    per mesh dimension, joined by ``-``: ``"replicate-shard0"`` for HSDP), ``""`` for a plain
    tensor.

    Args:
        t: a tensor, a DTensor (an FSDP2 parameter or gradient) or not.
    """
    if not is_dtensor(t):
        return ""
    from torch.distributed.tensor import Partial, Replicate, Shard  # imported: t is a DTensor

    names = []
    for placement in t.placements:  # type: ignore[attr-defined]  # a DTensor
        if isinstance(placement, Shard):
            names.append(f"shard{placement.dim}")
        elif isinstance(placement, Replicate):
            names.append("replicate")
        elif isinstance(placement, Partial):
            names.append("partial")
        else:
            names.append(type(placement).__name__.lower())
    return "-".join(names)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (sharing its storage), else ``t``."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


class FlatLayout:
    """Where each leaf of a parameter tree lives in the flat buffers (module docstring).

    ``groups`` maps each key to its ``FlatGroup``; within a group the segments follow the
    tree's leaf order, back to back. The layout depends only on names, shapes, dtypes and devices,
    so the same model always gets the same layout (checkpoints do not depend on accidents).

    Args:
        spec: the tree structure (an ``optree`` treespec) of the parameter tree.
        names: a readable name per leaf, in leaf order (the segments' names).
        metas: ``(shape, dtype, device)`` per leaf, in leaf order, or ``(shape, dtype, device,
            placement)`` for the local shard of a DTensor (``placement_of``).
        dict_keys: the tree's keys in leaf order when the tree is a flat dict (then :meth:`unflatten`
            builds the dict directly), else ``None``. :meth:`of` computes all four from a tree.
        max_bytes: the largest buffer, in bytes: a group that would grow past it continues in a
            new buffer (module docstring); ``None`` (default) for one buffer per group.
    """

    def __init__(
        self,
        spec: optree.PyTreeSpec,
        names: list,
        metas: list,
        dict_keys: Optional[list] = None,
        max_bytes: Optional[int] = None,
    ) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"FlatLayout: the buffer cap must be positive, got {max_bytes} bytes")
        self.spec = spec
        self._dict_keys = dict_keys  # the keys, in leaf order, when the tree is a flat dict
        segments: dict[str, list] = {}
        kinds: dict[str, tuple] = {}
        parts: dict[tuple, int] = {}  # (dtype, device, placement) -> the buffer being filled
        self._slots = []  # per leaf: (group key, index of its segment)
        for name, (shape, dtype, device, *placed) in zip(names, metas):
            placement = placed[0] if placed else ""
            kind = (dtype, device, placement)
            part = parts.setdefault(kind, 0)
            members = segments.get(group_key(dtype, device, part, placement), [])
            filled = members[-1].offset + members[-1].numel if members else 0  # elements
            if members and max_bytes is not None and (filled + math.prod(shape)) * dtype.itemsize > max_bytes:
                part = parts[kind] = part + 1
                filled = 0
            key = group_key(dtype, device, part, placement)
            kinds.setdefault(key, kind)
            members = segments.setdefault(key, [])
            members.append(Segment(name, filled, tuple(shape)))
            self._slots.append((key, len(members) - 1))
        self.groups = {
            key: FlatGroup(key, kinds[key][0], kinds[key][1], tuple(segs), sum(s.numel for s in segs), kinds[key][2])
            for key, segs in segments.items()
        }
        self._by_shape = {key: by_shape(group.segments) for key, group in self.groups.items()}
        self.meshes: dict[str, Any] = {}  # the DeviceMesh of each buffer of DTensors' shards (of() fills it)
        self.dtensor_shapes: dict[str, tuple] = {}  # per buffer of DTensors' shards: each DTensor's shape

    @classmethod
    def of(cls, params: Any, max_buffer_mb: Optional[float] = None) -> "FlatLayout":
        """The layout of a tree of tensors (no ``None`` leaves).

        Args:
            params: a pytree of dense tensors, such as :func:`~functional_bagua.params_of` gives; a
                leaf that is not a tensor or not dense raises a TypeError naming it. DTensors (an
                FSDP2 model's parameters) are laid out by their local shards (module docstring).
            max_buffer_mb: the largest flat buffer in MiB (module docstring); ``None`` (default)
                for one buffer per (dtype, device).

        Returns:
            A :class:`FlatLayout` with one group per (dtype, device) (or several, with
            ``max_buffer_mb``), in the tree's leaf order.
        """
        leaves, spec = tree.flatten(params)
        names = tree.leaf_names(spec)
        for name, leaf in zip(names, leaves):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(f"FlatLayout: leaf {name!r} is {type(leaf).__name__}, not a tensor")
            if leaf.layout != torch.strided:
                raise TypeError(f"FlatLayout: leaf {name!r} is {leaf.layout}; flat buffers hold dense tensors")
        if max_buffer_mb is not None and any(is_dtensor(leaf) for leaf in leaves):
            raise ValueError(
                "FlatLayout: max_buffer_mb cuts buffers by the sizes of each rank's local shards, which differ "
                "between ranks (uneven or empty shards), so the ranks' buffers would not match; lay out DTensors "
                "without a cap (max_buffer_mb=None)"
            )
        paths = optree.treespec_paths(spec)
        flat_dict = type(params) is dict and all(len(path) == 1 for path in paths)
        layout = cls(
            spec,
            names,
            [(tuple(local_part(p).shape), p.dtype, local_part(p).device, placement_of(p)) for p in leaves],
            [path[0] for path in paths] if flat_dict else None,
            None if max_buffer_mb is None else int(max_buffer_mb * 2**20),
        )
        for name, leaf, (key, _) in zip(names, leaves, layout._slots):  # the mesh of each buffer of shards
            if is_dtensor(leaf):
                layout.dtensor_shapes[key] = (*layout.dtensor_shapes.get(key, ()), tuple(leaf.shape))
                mesh = layout.meshes.setdefault(key, leaf.device_mesh)
                if mesh != leaf.device_mesh:
                    raise ValueError(
                        f"FlatLayout: {name!r} lies on another device mesh than the earlier "
                        f"DTensors of buffer {key!r}; lay out the parameters of each mesh separately"
                    )
        return layout

    @property
    def keys(self) -> list:
        return list(self.groups)

    @property
    def on_shards(self) -> bool:
        """Whether some buffer holds the local shards of DTensors (module docstring)."""
        return any(group.placement for group in self.groups.values())

    def segments(self, key: str) -> tuple:
        """The ``Segment`` of each tensor in the buffer ``key``, in leaf order.

        Args:
            key: a group key of this layout (one of ``keys``, e.g. ``"float32@cpu"``); any other
                raises a KeyError.
        """
        return self.groups[key].segments

    def shape_groups(self, key: str) -> tuple:
        """The non-empty tensors of the buffer ``key`` grouped by shape: ``(shape, rows)`` per
        shape, in the order each first occurs, ``rows`` (``Rows``) saying where they lie.
        Computed with the layout: plain Python values that a traced step reads as constants,
        whatever the number of tensors.

        Args:
            key: a group key of this layout (one of ``keys``); any other raises a KeyError.
        """
        return self._by_shape[key]

    def flatten(self, params: Any) -> dict:
        """``{key: buffer}``: the leaves of ``params`` (a tree of this layout) copied into new flat
        buffers, one ``torch.cat`` per group (of DTensors, their local shards). Do it once; then
        keep working on the buffers.

        Args:
            params: a tree of the layout's structure whose leaves are tensors of the shapes, dtypes
                and devices the layout was made for (otherwise a ValueError or TypeError names the
                leaf); it is not changed.
        """
        leaves = tree.leaves_matching(self.spec, params, "tree", "the layout's params")
        members: dict[str, list] = {key: [] for key in self.groups}
        for leaf, (key, i) in zip(leaves, self._slots):
            self._check_leaf(leaf, key, i)
            members[key].append(local_part(leaf).reshape(-1))
        return {key: torch.cat(parts) if len(parts) > 1 else parts[0].clone() for key, parts in members.items()}

    def _check_leaf(self, leaf: object, key: str, i: int) -> None:
        """Raise unless ``leaf`` is a tensor of the shape, dtype and device its segment was made for
        (a leaf of the same size but another shape would land in the wrong elements)."""
        group, seg = self.groups[key], self.groups[key].segments[i]
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"FlatLayout.flatten: leaf {seg.name!r} is {type(leaf).__name__}, not a tensor")
        local, placement = local_part(leaf), placement_of(leaf)
        if (
            tuple(local.shape) != seg.shape
            or leaf.dtype != group.dtype
            or local.device != group.device
            or placement != group.placement
        ):

            def described(shape: tuple, dtype: torch.dtype, device: torch.device, placement: str) -> str:
                return f"{shape} {dtype} on {device}" + (
                    f" (a DTensor's local shard, {placement})" if placement else ""
                )

            raise ValueError(
                f"FlatLayout.flatten: leaf {seg.name!r} is {described(tuple(local.shape), leaf.dtype, local.device, placement)}"
                f", the layout holds {described(seg.shape, group.dtype, group.device, group.placement)} there; make a "
                "layout of this tree with FlatLayout.of(tree)"
            )

    def unflatten(self, buffers: dict) -> Any:
        """The tree of this layout whose leaves are views into ``buffers`` (no copy); for DTensors,
        their local shards (plain tensors).

        The views come from one ``torch.split`` per group, which autograd differentiates with a
        single concatenation (per-slice views would each cost a full-size zero buffer).

        Args:
            buffers: flat buffers of this layout, ``{key: 1-D tensor}`` (checked with :meth:`check`),
                e.g. from :meth:`flatten` or a fused update.
        """
        self.check(buffers)
        pieces = {
            key: torch.split(buffers[key], [s.numel for s in group.segments]) for key, group in self.groups.items()
        }
        leaves = [pieces[key][i].view(self.groups[key].segments[i].shape) for key, i in self._slots]
        if self._dict_keys is not None:  # built directly: torch.compile cannot trace spec.unflatten
            return dict(zip(self._dict_keys, leaves))
        return self.spec.unflatten(leaves)

    def zeros(self) -> dict:
        """New zero buffers of this layout."""
        return {key: torch.zeros(g.numel, dtype=g.dtype, device=g.device) for key, g in self.groups.items()}

    def check(self, buffers: Any) -> None:
        """Raise naming what is wrong if ``buffers`` are not flat buffers of this layout.

        Args:
            buffers: what should be a dict with exactly the layout's keys, each value a 1-D tensor
                of its group's number of elements and dtype (the device is not checked).

        Raises:
            ValueError: for other keys, a value that is not a tensor, or a wrong shape or dtype.
        """
        if not isinstance(buffers, dict) or set(buffers) != set(self.groups):
            got = sorted(buffers) if isinstance(buffers, dict) else type(buffers).__name__
            raise ValueError(
                f"expected flat buffers with keys {sorted(self.groups)}, got {got}; make them with layout.flatten(tree)"
            )
        for key, group in self.groups.items():
            b = buffers[key]
            if not isinstance(b, torch.Tensor) or b.shape != (group.numel,) or b.dtype != group.dtype:
                desc = f"{tuple(b.shape)} {b.dtype}" if isinstance(b, torch.Tensor) else type(b).__name__
                raise ValueError(f"flat buffer {key!r} should be ({group.numel},) {group.dtype}, got {desc}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FlatLayout) and self.spec == other.spec and self.groups == other.groups

    def __hash__(self) -> int:
        return hash(tuple(self.groups))

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}: {len(g.segments)} tensors, {g.numel} elements" for k, g in self.groups.items())
        return f"FlatLayout({parts})"


def span(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """One 1-D view over ``tensors`` if they lie back to back in one storage, else ``None``.

    Back to back: each is contiguous, all share a dtype, and each starts where the previous one
    ends. The view lives in the first tensor's storage, so tensors that are merely adjacent in
    memory but belong to different storages give ``None`` (the view would run past the end).

    Args:
        tensors: a non-empty sequence of tensors, e.g. the parameters of a flattened group.

    Returns:
        ``flat`` with ``split_like(flat, tensors)[i]`` viewing the memory of ``tensors[i]``, or ``None``.

    Example::

        >>> buffer = torch.arange(5.0)
        >>> span([buffer[:2], buffer[2:]]).data_ptr() == buffer.data_ptr()
        True
    """
    first = tensors[0]
    start, itemsize, dtype = first.data_ptr(), first.element_size(), first.dtype
    total = 0
    for t in tensors:
        if t.dtype != dtype or not t.is_contiguous() or t.data_ptr() != start + total * itemsize:
            return None
        total += t.numel()
    try:
        return first.detach().as_strided((total,), (1,), first.storage_offset())
    except RuntimeError:  # past the end of the first tensor's storage: adjacent by accident
        return None


def split_like(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the 1-D ``flat`` shaped like ``tensors``, back to back (the inverse of :func:`span`).

    Args:
        flat: a 1-D tensor of at least as many elements as ``tensors`` hold together.
        tensors: tensors (or anything with ``shape`` and ``numel()``) giving the views' shapes.

    Example::

        >>> [tuple(v.shape) for v in split_like(torch.zeros(7), [torch.zeros(2, 2), torch.zeros(3)])]
        [(2, 2), (3,)]
    """
    pieces = flat.split([t.numel() for t in tensors])
    return [piece.view(t.shape) for piece, t in zip(pieces, tensors)]


@torch.no_grad()
def flatten_parameters(params: Any) -> tuple[FlatLayout, dict[str, torch.Tensor]]:
    """Move a tree of parameters into new flat buffers, one per (dtype, device), and re-point each
    parameter's ``.data`` to its view there. The ``Parameter`` objects keep their identity, so an
    optimizer or hook holding them keeps working; what reads ``.data`` reads the buffer.

    Args:
        params: a pytree of dense tensors (``Parameter`` s, usually), e.g. a list of one param
            group's parameters or ``dict(model.named_parameters())``; the tree's order is the
            buffers' order.

    Returns:
        ``(layout, buffers)``: the :class:`FlatLayout` of ``params`` and its flat buffers,
        ``{group key: 1-D tensor}``, which the parameters now view.

    Example::

        >>> ps = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.zeros(3))]
        >>> layout, buffers = flatten_parameters(ps)
        >>> buffers["float32@cpu"].tolist(), ps[1].data_ptr() == buffers["float32@cpu"][2:].data_ptr()
        ([1.0, 1.0, 0.0, 0.0, 0.0], True)
    """
    detached = tree.tree_map(torch.Tensor.detach, params)
    layout = FlatLayout.of(detached)
    if layout.on_shards:  # p.data = view would not re-point the shard FSDP2 holds
        raise TypeError(
            "flatten_parameters: the parameters are DTensors (an FSDP2 model's, say), whose local shards FSDP2 "
            "owns and cannot be re-pointed into flat buffers; use FlatLayout.of(params) and fb.fuse, and write "
            "the new values into p.to_local()"
        )
    buffers = layout.flatten(detached)
    for p, view in zip(tree.flatten(params)[0], tree.flatten(layout.unflatten(buffers))[0]):
        p.data = view
    return layout, buffers


class FlatModule(NamedTuple):
    """A module whose trainable parameters and gradients live in flat buffers:
    ``params[key]`` / ``grads[key]`` are the buffers the parameters' ``.data`` / ``.grad`` view.
    ``hooks``: the gradient hooks that keep it so (see :func:`flatten_module`)."""

    layout: FlatLayout
    params: dict
    grads: dict
    hooks: tuple = ()

    def zero_grad(self) -> None:
        """Zero the gradient buffers in place. ``module.zero_grad()`` works too: the next
        ``backward()`` puts the gradients back into the buffers (:func:`flatten_module`)."""
        for g in self.grads.values():
            g.zero_()

    def check(self, module: torch.nn.Module) -> None:
        """Raise if a parameter or gradient of ``module`` does not view its flat buffer
        (a replaced ``p.data``; ``.grad`` is ``None`` between ``zero_grad()`` and ``backward()``).

        Args:
            module: the module this :class:`FlatModule` was made from by :func:`flatten_module`.

        Raises:
            RuntimeError: naming the first parameter or gradient that is not a view of its buffer.
        """
        named = dict(module.named_parameters())
        for key, group in self.layout.groups.items():
            for seg in group.segments:
                p = named[seg.name]
                for what, t, buf in (("parameter", p, self.params[key]), ("gradient", p.grad, self.grads[key])):
                    if t is None or not _views(t, buf, seg):
                        raise RuntimeError(
                            f"the {what} of {seg.name!r} is no longer a view of its flat buffer {key!r} "
                            "(was .data replaced, or .grad set to None?); flatten the module again"
                        )

    def remove_hooks(self) -> None:
        """Remove the gradient hooks: gradients no longer return to the buffers by themselves."""
        for handle in self.hooks:
            handle.remove()


def _views(t: torch.Tensor, buffer: torch.Tensor, seg: Segment) -> bool:
    return t.data_ptr() == buffer.data_ptr() + seg.offset * buffer.element_size() and t.shape == seg.shape


class _GradientsHome:
    """Keeps every ``.grad`` of a flattened module a view of its flat gradient buffer.

    torch's ``zero_grad()`` (module or optimizer; ``set_to_none=True`` by default) drops the
    views, and the next ``backward()`` writes fresh tensors. After a parameter's gradient is
    accumulated, :meth:`after_accumulate` copies a fresh one into the parameter's view and
    re-points ``.grad`` there; at the end of that backward pass, :meth:`after_backward` gives
    every parameter that received no gradient a zeroed view (its old values would otherwise stay
    in the buffer). A parameter that no longer views its flat buffer (``p.data`` replaced)
    raises during ``backward()``: its values are not the buffer's any more."""

    def __init__(self, named: dict, layout: FlatLayout, params: dict, grads: dict) -> None:
        self.named, self.layout, self.params, self.grads = named, layout, params, grads
        self.views = {}  # name -> (segment, group key, gradient view)
        for key, group in layout.groups.items():
            grad_views = torch.split(grads[key], [seg.numel for seg in group.segments])
            for seg, view in zip(group.segments, grad_views):
                self.views[seg.name] = (seg, key, view.view(seg.shape))
        self.queued = False

    def grad_view(self, name: str) -> torch.Tensor:
        return self.views[name][2]

    @torch.no_grad()
    def after_accumulate(self, name: str, p: torch.Tensor) -> None:
        seg, key, view = self.views[name]
        if not _views(p, self.params[key], seg):
            raise RuntimeError(
                f"flatten_module: the parameter {name!r} no longer views its flat buffer {key!r} (was p.data "
                "replaced?), so the buffer does not hold its values; call flatten_module(model) again"
            )
        grad = p.grad
        if grad is view or grad is None:
            return
        view.copy_(grad)
        p.grad = view
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.after_backward)

    @torch.no_grad()
    def after_backward(self) -> None:
        self.queued = False
        for name, (_, _, view) in self.views.items():
            p = self.named[name]
            if p.grad is None:
                view.zero_()
                p.grad = view
            elif p.grad is not view:
                view.copy_(p.grad)
                p.grad = view


def flatten_module(module: torch.nn.Module) -> FlatModule:
    """Move ``module``'s trainable parameters into flat buffers and give each a gradient that is
    a view of a flat gradient buffer. The ``Parameter`` objects keep their identity (and any
    optimizer or hook holding them keeps working); ``backward()`` accumulates into the existing
    ``.grad`` views, so gradients land in the flat buffers with no copy.

    The usual ``model.zero_grad()`` / ``optimizer.zero_grad()`` (which set ``.grad`` to ``None``)
    keep working: a gradient hook copies the fresh gradients of the next ``backward()`` into the
    buffer (one copy per parameter; :meth:`FlatModule.zero_grad`, which zeroes the buffers in
    place, avoids it), and parameters without a gradient in that pass get zeros. A parameter
    whose ``.data`` was replaced makes ``backward()`` raise.

    Example::

        flat = fb.flatten_module(model)
        loss_fn(model(x), y).backward()
        flat.grads["float32@cpu"]           # every gradient, in one buffer

    Args:
        module: the module to flatten in place; its trainable parameters (``requires_grad=True``)
            move into the buffers, frozen ones stay as they are.

    Returns:
        A :class:`FlatModule` holding the layout, the parameter and gradient buffers, and the
        gradient hooks (:meth:`FlatModule.remove_hooks` removes them).
    """
    named = {name: p for name, p in module.named_parameters() if p.requires_grad}
    layout, params = flatten_parameters(named)
    grads = layout.zeros()
    home = _GradientsHome(named, layout, params, grads)
    with torch.no_grad():
        for name, p in named.items():
            p.grad = home.grad_view(name)
    hooks = tuple(
        p.register_post_accumulate_grad_hook(lambda p, name=name: home.after_accumulate(name, p))
        for name, p in named.items()
    )
    return FlatModule(layout, params, grads, hooks)
