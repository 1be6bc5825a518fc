"""Runs: consecutive parameters of a param group that one optimizer step can treat as one.

A run's members ``p_1 .. p_n`` lie back to back in one storage, have dense gradients, and have the
same state layout: the same keys, each either parameter-shaped (``exp_avg``), a 0-dim tensor with
the same value for all (``step``) or the same plain value. The optimizer then steps

    chunks = [p_1; ...; p_n] cut into pieces        (Parameter views of the members' storage)

with, per chunk, a gradient and state that are views of flat tensors whose member views are the
members' own ``.grad`` and ``state[p][key]``. So the step updates the members in place, and
afterwards only scalar state (``step``) has to be written back: one copy into a flat tensor
whose 0-dim views the members hold.

A :class:`Run` keeps what it gave out, one :class:`Tensors` / :class:`Scalars` / :class:`Value`
entry per state key, so that the next step can check that nothing moved (:meth:`Run.holds`, a
few identity comparisons per member) instead of planning again.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import attrgetter, eq, is_, is_not, ne, not_
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from functional_bagua.flat import span, split_like

if TYPE_CHECKING:
    from functional_bagua.compat.flatten import Home

CPU_CHUNK_BYTES = 4 << 20
CPU_FUSE_MAX_NUMEL = 1 << 15
CPU_UNFUSED_DTYPES = (torch.bfloat16, torch.float16)

_data_ptr = torch.Tensor.data_ptr
_grad_of = attrgetter("grad")
_dtype_of = attrgetter("dtype")


def signature(p: torch.Tensor, state: Optional[dict]) -> Optional[tuple]:
    """What a parameter must share with its neighbours to be fused with them, or ``None`` if it
    is stepped on its own: dtype, device, and per state key its kind, dtype and device.

    On the CPU a parameter of more than ``CPU_FUSE_MAX_NUMEL`` elements is stepped on its
    own: its kernels already run long enough to hide the per-tensor overhead fusion saves
    (a few microseconds per op), while a fresh gradient (after ``zero_grad(set_to_none=True)``)
    would cost a copy into the flat buffer, about 1 ns per element here. A bfloat16 or float16
    CPU parameter is stepped on its own too (:func:`fusable_on_its_device`).

    Args:
        p: a parameter of the group.
        state: its ``optimizer.state`` entry (``None`` if it has none).
    """
    g = p.grad
    if state is not None and type(state) is not dict:
        return None
    if g is None or g.layout != torch.strided or g.shape != p.shape or g.dtype != p.dtype:  # a grad_dtype of its own
        return None
    if p.dim() == 0 or p.is_complex() or not p.is_contiguous():
        return None
    if not fusable_on_its_device(p):
        return None
    sig: list = [p.dtype, p.device]
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

    - more than ``CPU_FUSE_MAX_NUMEL`` elements (see :func:`signature`);
    - bfloat16 or float16 (``CPU_UNFUSED_DTYPES``). torch's CPU kernels compute these in a
      vectorized loop and a scalar tail that round intermediate results differently, so on one
      flat tensor some elements move from tail to loop and come out different: measured over 3
      steps of 510 elements, 99 for SGD with momentum, 13 for centered RMSprop, 1 for a
      BertAdam-style Adam. The probe sees the frequent cases but cannot be sure to see the rare
      ones, so these dtypes are not fused on the CPU at all.

    Args:
        p: a parameter.
    """
    if p.device.type != "cpu":
        return True
    return p.numel() <= CPU_FUSE_MAX_NUMEL and p.dtype not in CPU_UNFUSED_DTYPES


def candidate_runs(params: list, state: dict) -> tuple[list, list]:
    """``(candidates, alone)``: maximal lists of parameters that lie back to back (per device
    and dtype, in group order) with equal signatures, and the parameters that cannot be fused.

    Args:
        params: a param group's parameters.
        state: the optimizer's state.
    """
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


def split_by_scalars(params: list, state: dict) -> list:
    """``params`` cut where a 0-dim state tensor (e.g. ``step``) changes value: a fused step
    uses one value for the whole run.

    Args:
        params: parameters with equal signatures (:func:`signature`).
        state: the optimizer's state.
    """
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


def chunk_bounds(flat: torch.Tensor) -> list:
    """``[(start, end), ...]`` cutting ``flat`` into pieces of at most ``CPU_CHUNK_BYTES``
    on the CPU; one piece elsewhere (an accelerator wants few, large launches).

    Args:
        flat: a run's flat parameter.
    """
    n = flat.numel()
    if flat.device.type != "cpu":
        return [(0, n)]
    size = max(1, CPU_CHUNK_BYTES // flat.element_size())
    return [(a, min(a + size, n)) for a in range(0, n, size)]


# ---- what a run gave out, per state key ------------------------------------------------------------


class Tensors(NamedTuple):
    """A parameter-shaped state key (or the gradients): ``members[i]`` is member ``i``'s tensor and
    ``chunks[j]`` chunk ``j``'s, all views of ``flat``."""

    flat: torch.Tensor
    members: list
    chunks: list

    def held_by(self, found: list) -> bool:
        return all(map(is_, found, self.members))

    def for_chunk(self, j: int) -> torch.Tensor:
        return self.chunks[j]


class Scalars(NamedTuple):
    """A 0-dim state key (``step``), one value for the whole run. ``members[i]`` is member ``i``'s
    own 0-dim tensor, a view of ``flat`` (so writing the value back is one copy); ``chunks[j]`` is
    the 0-dim tensor the optimizer updates for chunk ``j``. Views share their base's version
    counter, so ``version``, the counter when the run last wrote ``flat``, changes when anyone
    changes any member in place (a plain ``step()`` in between)."""

    flat: torch.Tensor
    members: list
    chunks: list
    version: int

    def held_by(self, found: list) -> bool:
        return all(map(is_, found, self.members)) and self.flat._version == self.version

    def for_chunk(self, j: int) -> torch.Tensor:
        return self.chunks[j]


class Value(NamedTuple):
    """A state key holding the same plain (non-tensor) value for every member."""

    value: Any

    def held_by(self, found: list) -> bool:
        return all(_same_value(v, self.value) for v in found)

    def for_chunk(self, j: int) -> Any:
        return self.value


class Run:
    """Members stepped as one (module docstring).

    The optimizer sees the run as ``chunks``: ``Parameter`` views of consecutive pieces of the
    flat storage, each at most ``CPU_CHUNK_BYTES`` on the CPU (one on other devices). A
    for-loop optimizer's temporaries then stay small enough for the allocator to reuse them
    (one 400 MB temporary per step costs page faults, and peak memory); a piece may cut a
    member in two, which elementwise math does not notice. benchmarks/RESULTS.md compares the
    piece sizes (4 MiB against 1 MiB and 32 MiB).

    Args:
        params: the members, back to back in one storage (``flat`` views them all).
        flat: ``span(params)``.
        state: the optimizer's state; the members' gradients and state tensors move into flat
            tensors (``home``'s slices, or new ones) unless they are back to back already.
        home: where the run sits in a :class:`~functional_bagua.compat.flatten.FlattenedGroup`, if it does.
    """

    def __init__(self, params: list, flat: torch.Tensor, state: dict, home: Optional[Home] = None) -> None:
        self.params, self.flat, self.home = params, flat, home
        self.bounds = chunk_bounds(flat)
        self.chunks = [torch.nn.Parameter(flat[a:b], requires_grad=False) for a, b in self.bounds]
        self._pointers = list(map(_data_ptr, params))
        grads = [p.grad for p in params]
        self.grads = self._tensors(grads, None if home is None else home.grads())
        for p, view in zip(params, self.grads.members):
            if p.grad is not view:
                p.grad = view
        for chunk, view in zip(self.chunks, self.grads.chunks):
            chunk.grad = view
        self._grads_seen = list(map(id, self.grads.members))  # ids of the gradients at the last fused step
        self.state: dict = {}  # key -> Tensors | Scalars | Value
        for key, value in (state.get(params[0]) or {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                home_slice = None if home is None else home.state(key, value)
                self._give_tensors(state, key, self._tensors([state[p][key] for p in params], home_slice))
            elif isinstance(value, torch.Tensor):
                self._give_scalars(state, key, value, [value.clone() for _ in self.chunks])
            else:
                self.state[key] = Value(value)

    # ---- before the step ------------------------------------------------------------------

    def moved_gradients(self) -> Optional[list]:
        """The members' ``.grad`` in member order, or ``None`` when each is its flat view (the
        usual case with gradients kept in place: nothing to check or bring in)."""
        grads = list(map(_grad_of, self.params))
        return None if all(map(is_, grads, self.grads.members)) else grads

    def holds(self, states: list, grads: list) -> bool:
        """Whether the members are where this run left them: parameters at the same place, each
        with a gradient of the run's dtype, and state entries that are still the run's, scalars
        unchanged since the run wrote them. Reads only.

        Args:
            states: the members' ``optimizer.state`` dicts, in member order (``{}`` for none).
            grads: :meth:`moved_gradients`.
        """
        if list(map(_data_ptr, self.params)) != self._pointers:
            return False
        if grads is not None and (
            any(map(is_, grads, repeat(None))) or any(map(ne, map(_dtype_of, grads), repeat(self.flat.dtype)))
        ):
            return False  # a gradient is missing, or has another dtype (p.grad_dtype was changed)
        if any(map(is_not, map(type, states), repeat(dict))) or any(map(ne, map(len, states), repeat(len(self.state)))):
            return False
        return all(entry.held_by(list(map(dict.get, states, repeat(key)))) for key, entry in self.state.items())

    def bring_in_grads(self, grads: Optional[list]) -> None:
        """Copy the members' gradients ``grads`` (:meth:`moved_gradients`) that are not their flat
        views into the flat gradient.

        A fresh gradient (after ``zero_grad(set_to_none=True)``) is copied and left where it is:
        ``zero_grad`` drops it before the next ``backward`` anyway. A gradient seen at the last
        fused step too (it survived ``zero_grad(set_to_none=False)``, which zeroes in place) is
        re-pointed to its view, so that later steps find it in place."""
        if grads is None:
            return
        views = self.grads.members
        in_place = list(map(is_, grads, views))
        with torch.no_grad():
            if any(in_place):
                moved = list(compress(range(len(grads)), map(not_, in_place)))
                torch._foreach_copy_([views[i] for i in moved], [grads[i] for i in moved])
            else:  # all fresh, the usual case: no index lists
                torch._foreach_copy_(views, grads)
        ids = list(map(id, grads))
        for i in compress(range(len(grads)), map(eq, ids, self._grads_seen)):
            if not in_place[i]:
                self.params[i].grad = views[i]
        self._grads_seen = ids

    def chunk_states(self) -> list:
        """The state the optimizer sees for each chunk, in ``chunks`` order."""
        return [{key: entry.for_chunk(j) for key, entry in self.state.items()} for j in range(len(self.chunks))]

    # ---- after the step -------------------------------------------------------------------

    def take_back(self, state: dict, chunk_states: list, optimizer_name: str) -> None:
        """Give every member its part of the state the optimizer left for the chunks.

        Args:
            state: the optimizer's state.
            chunk_states: the chunks' state dicts after the step, in ``chunks`` order.
            optimizer_name: the optimizer's class name, for error messages.
        """
        for key, value in chunk_states[0].items():
            given = self.state.get(key)
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                pieces = [s[key] for s in chunk_states]
                if isinstance(given, Tensors) and all(map(is_, pieces, given.chunks)):
                    continue  # updated in place, in the members' own storage
                self._give_tensors(state, key, self._joined(key, pieces, optimizer_name))
            elif isinstance(value, torch.Tensor):
                self._write_scalars(state, key, given, [s[key] for s in chunk_states])
            else:
                for p in self.params:
                    state[p][key] = value
                self.state[key] = Value(value)
        for key in [k for k in self.state if k not in chunk_states[0]]:
            for p in self.params:
                state[p].pop(key, None)
            del self.state[key]

    @torch.no_grad()
    def _write_scalars(self, state: dict, key: str, given: Any, chunks: list) -> None:
        """Copy the value of the chunks' 0-dim ``key`` into every member's own 0-dim tensor: one
        copy into the flat tensor they view (:meth:`holds` checked that they still do)."""
        value = chunks[0]
        if not isinstance(given, Scalars) or given.flat.dtype != value.dtype or given.flat.device != value.device:
            self._give_scalars(state, key, value, chunks)
            return
        given.flat.fill_(value)
        self.state[key] = given._replace(chunks=chunks, version=given.flat._version)

    def _joined(self, key: str, pieces: list, optimizer_name: str) -> Tensors:
        """New per-chunk state tensors (the optimizer's first step makes them) joined into one
        flat tensor, in the run's home when it has one."""
        for (a, b), piece in zip(self.bounds, pieces):
            if piece.shape != (b - a,):
                raise RuntimeError(
                    f"fuse_step: {optimizer_name} made state {key!r} of shape {tuple(piece.shape)} for a fused "
                    f"parameter of shape {(b - a,)}; it cannot be split back per parameter"
                )
        if self.home is None and len(pieces) == 1:
            return self._views_of(pieces[0])
        out = (
            self.home.state(key, pieces[0])
            if self.home is not None
            else torch.empty(self.flat.numel(), dtype=pieces[0].dtype, device=pieces[0].device)
        )
        with torch.no_grad():
            for (a, b), piece in zip(self.bounds, pieces):
                out[a:b].copy_(piece)
        return self._views_of(out)

    # ---- giving out flat tensors --------------------------------------------------------------

    def _views_of(self, flat: torch.Tensor) -> Tensors:
        return Tensors(flat, split_like(flat, self.params), [flat[a:b] for a, b in self.bounds])

    @torch.no_grad()
    def _tensors(self, tensors: list, out: Optional[torch.Tensor]) -> Tensors:
        """``tensors`` (one per member) as views of one flat tensor: themselves when they are back
        to back already, else copies in ``out`` (or a new tensor)."""
        flat = span(tensors)
        if flat is not None:
            return Tensors(flat, list(tensors), [flat[a:b] for a, b in self.bounds])
        if out is None:
            out = torch.cat([t.detach().reshape(-1) for t in tensors])
            return self._views_of(out)
        entry = self._views_of(out)
        moved = [(v, t.detach()) for v, t in zip(entry.members, tensors) if v.data_ptr() != t.data_ptr()]
        if moved:
            targets, sources = (list(side) for side in zip(*moved))
            torch._foreach_copy_(targets, sources)
        return entry

    def _give_tensors(self, state: dict, key: str, entry: Tensors) -> None:
        """Make ``state[p][key]`` the member views of ``entry``."""
        for p, view in zip(self.params, entry.members):
            state[p][key] = view
        self.state[key] = entry

    @torch.no_grad()
    def _give_scalars(self, state: dict, key: str, value: torch.Tensor, chunks: list) -> None:
        """Make ``state[p][key]`` 0-dim views of one new flat tensor holding ``value`` for every
        member: each member still has its own 0-dim tensor (a plain ``step()`` adds to it in
        place), and writing them all back after a fused step is one copy."""
        flat = value.detach().expand(len(self.params)).clone()
        members = list(flat.unbind())
        for p, t in zip(self.params, members):
            state[p][key] = t
        self.state[key] = Scalars(flat, members, chunks, flat._version)


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False
