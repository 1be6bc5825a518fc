"""Runs: consecutive parameters of a param group that one optimizer step can treat as one.

A run's members lie back to back in one storage, have dense gradients, and have the same state
layout: the same keys, each either parameter-shaped (``exp_avg``), a 0-dim tensor with the same
value for all (``step``) or the same plain value. A :class:`Run` keeps

- ``flat``: a ``Parameter`` viewing all members' storage (what the optimizer steps),
- ``flat.grad`` and one flat tensor per parameter-shaped state key, whose views are the
  members' ``.grad`` and ``state[p][key]`` (copied there once if they were elsewhere),
- per scalar key, a 0-dim tensor per chunk that the optimizer updates, and the members' own
  0-dim tensors as views of one flat tensor, so that writing the value back is one copy,

and remembers what it gave out, so that the next step can check that nothing moved
(:meth:`Run.still_valid`: a few identity comparisons per member, each a C-level ``map``)
instead of planning again.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import attrgetter, eq, is_, is_not, itemgetter, ne, not_
from typing import Callable, NamedTuple, Optional

import torch

from functional_bagua.compat.spans import gather, span, split_like

CPU_CHUNK_BYTES = 4 << 20
CPU_FUSE_MAX_NUMEL = 1 << 15
CPU_UNFUSED_DTYPES = (torch.bfloat16, torch.float16)

_data_ptr = torch.Tensor.data_ptr
_grad_of = attrgetter("grad")
_dtype_of = attrgetter("dtype")
_NO_STATE: dict = {}  # what still_valid reads for a parameter without state (never written)


class StateIndex:
    """``optimizer.state``'s per-parameter dicts, read by position instead of by key.

    Looking a tensor up in ``optimizer.state`` calls ``Tensor.__hash__``, a Python function.
    :meth:`read` instead takes the keys' ids and the values in order (C-level
    copies) and, while the ids are the same in the same order as last time, a run reads its
    members' dicts at remembered positions (a member is alive, so no other key can have its
    id); any insertion or deletion starts a new ``generation`` of positions. The values are
    read afresh on every step, so a dict replaced under an existing key
    (``optimizer.state[p] = {}``) is seen, and dropped by :meth:`release` after the step."""

    def __init__(self):
        self.key_ids: list = []
        self.generation = 0
        self.values: list = []
        self._positions: dict = {}

    def read(self, state) -> None:
        key_ids = list(map(id, state))
        if key_ids != self.key_ids:
            self.key_ids, self._positions = key_ids, {}
            self.generation += 1
        self.values = list(state.values())
        self.values.append(_NO_STATE)  # at position len(key_ids): parameters without state

    def release(self) -> None:
        self.values = []

    def getter(self, params: list) -> Callable:
        """A function of ``values`` giving ``params``' state dicts (``_NO_STATE`` for none)."""
        if not self._positions:
            self._positions = {k: i for i, k in enumerate(self.key_ids)}
        missing = len(self.key_ids)
        return itemgetter(*[self._positions.get(id(p), missing) for p in params])


def signature(p: torch.Tensor, state: Optional[dict]):
    """What a parameter must share with its neighbours to be fused with them, or ``None`` if it
    is stepped on its own: dtype, device, and per state key its kind, dtype and device.

    On the CPU a parameter of more than :data:`CPU_FUSE_MAX_NUMEL` elements is stepped on its
    own: its kernels already run long enough to hide the per-tensor overhead fusion saves
    (a few microseconds per op), while a fresh gradient (after ``zero_grad(set_to_none=True)``)
    would cost a copy into the flat buffer, about 1 ns per element here. A bfloat16 or float16
    CPU parameter is stepped on its own too (:func:`fusable_on_its_device`)."""
    g = p.grad
    if state is not None and type(state) is not dict:
        return None
    if g is None or g.layout != torch.strided or g.shape != p.shape or g.dtype != p.dtype:  # a grad_dtype of its own
        return None
    if p.dim() == 0 or p.is_complex() or not p.is_contiguous():
        return None
    if not fusable_on_its_device(p):
        return None
    sig = [p.dtype, p.device]
    for key, value in (state or {}).items():
        if isinstance(value, torch.Tensor):
            if value.dim() > 0 and value.shape == p.shape:
                sig.append((key, "param-shaped", value.dtype, value.device))
            elif value.dim() == 0:
                sig.append((key, "scalar", value.dtype, value.device))
            else:
                return None
        else:
            try:
                hash(value)
            except TypeError:
                return None
            sig.append((key, "value", type(value), value))
    return tuple(sig)


def fusable_on_its_device(p: torch.Tensor) -> bool:
    """False for a CPU parameter that fusion would not speed up or could change; such a
    parameter is neither fused nor moved into a flat buffer:

    - more than :data:`CPU_FUSE_MAX_NUMEL` elements (see :func:`signature`);
    - bfloat16 or float16 (:data:`CPU_UNFUSED_DTYPES`). torch's CPU kernels compute these in a
      vectorized loop and a scalar tail that round intermediate results differently, so on one
      flat tensor some elements move from tail to loop and come out different: measured over 3
      steps of 510 elements, 99 for SGD with momentum, 13 for centered RMSprop, 1 for a
      BertAdam-style Adam. The probe sees the frequent cases but cannot be sure to see the rare
      ones, so these dtypes are not fused on the CPU at all.
    """
    if p.device.type != "cpu":
        return True
    return p.numel() <= CPU_FUSE_MAX_NUMEL and p.dtype not in CPU_UNFUSED_DTYPES


def candidate_runs(params: list, state) -> tuple:
    """``(candidates, alone)``: maximal lists of parameters that lie back to back (per device
    and dtype, in group order) with equal signatures, and the parameters that cannot be fused."""
    candidates, alone = [], []
    open_runs: dict = {}  # (device, dtype) -> (members, where the last one ends, signature)
    for p in params:
        sig = signature(p, state.get(p))
        if sig is None:
            alone.append(p)
            continue
        kind = (p.device, p.dtype)
        members, end, open_sig = open_runs.get(kind, (None, None, None))
        if members is None or p.data_ptr() != end or sig != open_sig:
            members = []
            candidates.append(members)
        members.append(p)
        open_runs[kind] = (members, p.data_ptr() + p.numel() * p.element_size(), sig)
    return [part for c in candidates for part in split_by_scalars(c, state)], alone


def split_by_scalars(params: list, state) -> list:
    """``params`` cut where a 0-dim state tensor (e.g. ``step``) changes value: a fused step
    uses one value for the whole run."""
    first = state.get(params[0]) or {}
    keys = [k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim() == 0]
    if not keys or len(params) < 2:
        return [params]
    values = list(zip(*[_scalar_values([state[p][k] for p in params]) for k in keys]))
    parts, start = [], 0
    for i in range(1, len(params) + 1):
        if i == len(params) or values[i] != values[start]:
            parts.append(params[start:i])
            start = i
    return parts


def _scalar_values(tensors: list) -> list:
    """Python values of 0-dim tensors: ``item()`` on the CPU, one transfer on an accelerator."""
    if tensors[0].device.type == "cpu":
        return [t.item() for t in tensors]
    return torch.stack(tensors).tolist()


class _Scalars(NamedTuple):
    """A run's 0-dim state tensors for one key (``step``): ``members[i]`` is parameter ``i``'s,
    a view of ``flat``. Views share their base's version counter, so ``version``, the counter
    when the run last wrote them, changes when anyone changes any member in place."""

    flat: torch.Tensor
    members: list
    version: int


class Run:
    """Members stepped as one (module docstring). ``place("grad" | "state", key, like)`` returns
    the slice of a flat buffer where the run's gradients or ``key`` state (dtype and device of
    ``like``) should live, or ``None`` for a new tensor.

    The optimizer sees the run as ``chunks``: ``Parameter`` views of consecutive pieces of the
    flat storage, each at most :data:`CPU_CHUNK_BYTES` on the CPU (one on other devices). A
    for-loop optimizer's temporaries then stay small enough for the allocator to reuse them
    (one 400 MB temporary per step costs page faults, and peak memory); a piece may cut a
    member in two, which elementwise math does not notice. benchmarks/RESULTS.md compares the
    piece sizes (4 MiB against 1 MiB and 32 MiB).
    """

    def __init__(self, params: list, flat: torch.Tensor, state, place: Callable):
        self.params, self.flat, self.place = params, flat, place
        self.bounds = chunk_bounds(flat)
        self.chunks = [torch.nn.Parameter(flat[a:b], requires_grad=False) for a, b in self.bounds]
        self._pointers = list(map(_data_ptr, params))
        self._states_of: Optional[Callable] = None  # see StateIndex
        self._states_generation = -1
        self._moved_grads: Optional[list] = None  # the members' .grad as still_valid saw them, if not all views
        self.flat_grad: torch.Tensor = torch.empty(0)  # set by _adopt_grads below
        self._grad_ids: list = []
        self.grad_views: list = []
        self.state_views: dict = {}  # key -> members' views of self.flat_state[key]
        self.flat_state: dict = {}  # key -> flat tensor (parameter-shaped keys)
        self.chunk_state: dict = {}  # key -> chunks' views of self.flat_state[key]
        self.scalars: dict = {}  # key -> _Scalars: the members' 0-dim tensors, views of one flat tensor
        self.chunk_scalars: dict = {}  # key -> one 0-dim tensor per chunk, which the optimizer updates
        self.values: dict = {}  # key -> plain value shared by the members
        self._adopt_grads()
        first = state.get(params[0]) or {}
        for key, value in first.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                self._adopt_state(
                    state, key, *self._flat_of([state[p][key] for p in params], self.place("state", key, value))
                )
            elif isinstance(value, torch.Tensor):
                self._adopt_scalar(state, key, value)
                self.chunk_scalars[key] = [value.clone() for _ in self.chunks]
            else:
                self.values[key] = value

    # ---- before the step ------------------------------------------------------------------

    def still_valid(self, index: StateIndex, check_pointers: bool = True) -> bool:
        """Whether the members are where this run left them: parameters at the same place
        (``check_pointers=False`` when the caller checked that already), with a gradient, and
        state entries that are still the run's views, scalars unchanged since the run wrote them
        (a plain ``step()`` in between changes them). Each check is one ``map`` over the
        members, so that it costs well under a microsecond per member."""
        params, n = self.params, len(self.params)
        if check_pointers and list(map(_data_ptr, params)) != self._pointers:
            return False
        grads = list(map(_grad_of, params))
        in_place = all(map(is_, grads, self.grad_views))
        if not in_place and (
            any(map(is_, grads, repeat(None))) or any(map(ne, map(_dtype_of, grads), repeat(self.flat_grad.dtype)))
        ):
            return False  # a gradient is missing, or has another dtype (p.grad_dtype was changed)
        self._moved_grads = None if in_place else grads  # for _refresh_grads, in this step
        states_of = self._states_of
        if states_of is None or self._states_generation != index.generation:
            states_of = self._states_of = index.getter(params)
            self._states_generation = index.generation
        states = states_of(index.values)
        if any(map(is_not, map(type, states), repeat(dict))):
            return False
        if any(map(ne, map(len, states), repeat(len(self.state_views) + len(self.scalars) + len(self.values)))):
            return False
        for key, views in self.state_views.items():
            if not all(map(is_, map(dict.get, states, repeat(key, n)), views)):
                return False
        for key, scalars in self.scalars.items():
            if not all(map(is_, map(dict.get, states, repeat(key, n)), scalars.members)):
                return False
            if scalars.flat._version != scalars.version:  # the members share flat's version counter
                return False
        for key, value in self.values.items():
            if not all(_same_value(v, value) for v in map(dict.get, states, repeat(key, n))):
                return False
        return True

    def fused_states(self) -> list:
        """Bring fresh gradients into the flat gradient; the state the optimizer sees for each
        chunk, in ``chunks`` order."""
        self._refresh_grads()
        states = []
        for i in range(len(self.chunks)):
            s = {key: views[i] for key, views in self.chunk_state.items()}
            s.update({key: tensors[i] for key, tensors in self.chunk_scalars.items()})
            s.update(self.values)
            states.append(s)
        return states

    @torch.no_grad()
    def _refresh_grads(self) -> None:
        """Copy gradients that are not the run's views into the flat gradient.

        A fresh gradient (after ``zero_grad(set_to_none=True)``) is copied and left where it
        is: ``zero_grad`` drops it before the next ``backward`` anyway. A gradient that is not
        a view but survived since the last fused step (``zero_grad(set_to_none=False)``, which
        zeroes in place) is re-pointed to its view, so that later steps find it in place."""
        grads, self._moved_grads = self._moved_grads, None
        if grads is None:  # every member's gradient is its view
            return
        views = self.grad_views
        same = list(map(is_, grads, views))
        if any(same):
            stale = list(compress(range(len(grads)), map(not_, same)))
            torch._foreach_copy_([views[i] for i in stale], [grads[i] for i in stale])
        else:  # all fresh, the usual case: no index lists
            torch._foreach_copy_(views, grads)
        ids = list(map(id, grads))
        for i in compress(range(len(grads)), map(eq, ids, self._grad_ids)):
            if not same[i]:
                self.params[i].grad = views[i]
        self._grad_ids = ids

    # ---- after the step -------------------------------------------------------------------

    def scatter(self, state, chunk_states: list, optimizer_name: str) -> None:
        """Give every member its part of the state the optimizer left for the chunks."""
        for key, value in chunk_states[0].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                pieces = [s[key] for s in chunk_states]
                given = self.chunk_state.get(key)
                if given is not None and all(a is b for a, b in zip(pieces, given)):
                    continue  # updated in place, in the members' own storage
                self._adopt_state(state, key, self._joined(key, pieces, optimizer_name))
            elif isinstance(value, torch.Tensor):
                self._write_scalar(state, key, value)
                self.chunk_scalars[key] = [s[key] for s in chunk_states]
            else:
                for p in self.params:
                    state[p][key] = value
                self.values[key] = value
        for key in [k for k in (*self.state_views, *self.scalars, *self.values) if k not in chunk_states[0]]:
            for p in self.params:
                state[p].pop(key, None)
            for record in (
                self.state_views,
                self.flat_state,
                self.chunk_state,
                self.scalars,
                self.chunk_scalars,
                self.values,
            ):
                record.pop(key, None)

    def _joined(self, key, pieces: list, optimizer_name: str) -> torch.Tensor:
        """New per-chunk state tensors (the optimizer's first step makes them) as one flat
        tensor, in the run's flat buffer slice when it has one."""
        for (a, b), piece in zip(self.bounds, pieces):
            if piece.shape != (b - a,):
                raise RuntimeError(
                    f"fuse_step: {optimizer_name} made state {key!r} of shape {tuple(piece.shape)} for a fused "
                    f"parameter of shape {(b - a,)}; it cannot be split back per parameter"
                )
        out = self.place("state", key, pieces[0])
        if out is None and len(pieces) == 1:
            return pieces[0]
        if out is None:
            out = torch.empty(self.flat.numel(), dtype=pieces[0].dtype, device=pieces[0].device)
        for (a, b), piece in zip(self.bounds, pieces):
            out[a:b].copy_(piece)
        return out

    @torch.no_grad()
    def _write_scalar(self, state, key, value: torch.Tensor) -> None:
        """Copy the fused 0-dim ``key`` into every member's own 0-dim tensor: one copy into
        the flat tensor they view (still_valid checked that they are still the members')."""
        known = self.scalars.get(key)
        if known is None or known.flat.dtype != value.dtype or known.flat.device != value.device:
            self._adopt_scalar(state, key, value)
            return
        known.flat.fill_(value)
        self.scalars[key] = _Scalars(known.flat, known.members, known.flat._version)

    # ---- moving tensors into flat buffers -------------------------------------------------

    @torch.no_grad()
    def _adopt_scalar(self, state, key, value: torch.Tensor) -> None:
        """Make ``state[p][key]`` 0-dim views of one new flat tensor holding ``value`` for every
        member: each member still has its own 0-dim tensor (a plain ``step()`` adds to it in
        place), and writing them all back after a fused step is one copy."""
        flat = value.detach().expand(len(self.params)).clone()
        members = list(flat.unbind())
        for p, t in zip(self.params, members):
            state[p][key] = t
        self.scalars[key] = _Scalars(flat, members, flat._version)

    # ---- moving tensors into flat buffers -------------------------------------------------

    def _adopt_grads(self) -> None:
        self.flat_grad, views = self._flat_of([p.grad for p in self.params], self.place("grad", None, None))
        for p, v in zip(self.params, views):
            if p.grad is not v:
                p.grad = v
        for chunk, (a, b) in zip(self.chunks, self.bounds):
            chunk.grad = self.flat_grad[a:b]
        self.grad_views = [p.grad for p in self.params]
        self._grad_ids = list(map(id, self.grad_views))  # ids of the gradients of the last fused step

    def _adopt_state(self, state, key, flat: torch.Tensor, views: Optional[list] = None) -> None:
        """Make ``state[p][key]`` the member views (``views``, or split from ``flat``) of one flat tensor."""
        if views is None:
            views = split_like(flat, self.params)
        for p, v in zip(self.params, views):
            state[p][key] = v
        self.flat_state[key], self.state_views[key] = flat, views
        self.chunk_state[key] = [flat[a:b] for a, b in self.bounds]

    @staticmethod
    def _flat_of(tensors: list, out: Optional[torch.Tensor]) -> tuple:
        """``(flat, views)`` with ``views[i] == tensors[i]``: the tensors themselves when they
        are back to back already, else copies in ``out`` (or a new tensor)."""
        flat = span(tensors)
        if flat is not None:
            return flat, list(tensors)
        if out is None:
            return gather(tensors)
        views = split_like(out, tensors)
        moved = [(v, t.detach()) for v, t in zip(views, tensors) if v.data_ptr() != t.data_ptr()]
        if moved:
            targets, sources = (list(side) for side in zip(*moved))
            torch._foreach_copy_(targets, sources)
        return out, views


def chunk_bounds(flat: torch.Tensor) -> list:
    """``[(start, end), ...]`` cutting ``flat`` into pieces of at most :data:`CPU_CHUNK_BYTES`
    on the CPU; one piece elsewhere (an accelerator wants few, large launches)."""
    n = flat.numel()
    if flat.device.type != "cpu":
        return [(0, n)]
    size = max(1, CPU_CHUNK_BYTES // flat.element_size())
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def _same_value(a, b) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False
