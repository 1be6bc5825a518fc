"""Runs: consecutive parameters of a param group that one optimizer step can treat as one.

A run's members lie back to back in one storage, have dense gradients, and have the same state
layout: the same keys, each either parameter-shaped (``exp_avg``), a 0-dim tensor with the same
value for all (``step``) or the same plain value. A :class:`Run` keeps

- ``flat``: a ``Parameter`` viewing all members' storage (what the optimizer steps),
- ``flat.grad`` and one flat tensor per parameter-shaped state key, whose views are the
  members' ``.grad`` and ``state[p][key]`` (copied there once if they were elsewhere),
- one fused 0-dim tensor per scalar key, copied back to every member after each step,

and remembers what it gave out, so that the next step can check in a few pointer comparisons
per member that nothing moved (:meth:`Run.still_valid`) instead of planning again.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from functional_bagua.compat.spans import gather, span, split_like


CPU_CHUNK_BYTES = 1 << 20
CPU_FUSE_MAX_NUMEL = 1 << 15


def signature(p: torch.Tensor, state: Optional[dict]):
    """What a parameter must share with its neighbours to be fused with them, or ``None`` if it
    is stepped on its own: dtype, device, and per state key its kind, dtype and device.

    On the CPU a parameter of more than :data:`CPU_FUSE_MAX_NUMEL` elements is stepped on its
    own: its kernels already run long enough to hide the per-tensor overhead fusion saves
    (a few microseconds per op), while a fresh gradient (after ``zero_grad(set_to_none=True)``)
    would cost a copy into the flat buffer, about 1 ns per element here."""
    g = p.grad
    if g is None or g.is_sparse or g.shape != p.shape or p.dim() == 0 or p.is_complex() or not p.is_contiguous():
        return None
    if p.device.type == "cpu" and p.numel() > CPU_FUSE_MAX_NUMEL:
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


class Run:
    """Members stepped as one (module docstring). ``place("grad" | "state", key, like)`` returns
    the slice of a flat buffer where the run's gradients or ``key`` state (dtype and device of
    ``like``) should live, or ``None`` for a new tensor.

    The optimizer sees the run as ``chunks``: ``Parameter`` views of consecutive pieces of the
    flat storage, each at most :data:`CPU_CHUNK_BYTES` on the CPU (one on other devices). A
    for-loop optimizer's temporaries then stay small enough for the allocator to reuse them
    (one 400 MB temporary per step costs page faults, and peak memory); a piece may cut a
    member in two, which elementwise math does not notice.
    """

    def __init__(self, params: list, flat: torch.Tensor, state, place: Callable):
        self.params, self.flat, self.place = params, flat, place
        self.bounds = chunk_bounds(flat)
        self.chunks = [torch.nn.Parameter(flat[a:b], requires_grad=False) for a, b in self.bounds]
        self._pointers = [p.data_ptr() for p in params]
        self.flat_grad: Optional[torch.Tensor] = None
        self.grad_views: list = []
        self.state_views: dict = {}  # key -> members' views of self.flat_state[key]
        self.flat_state: dict = {}  # key -> flat tensor (parameter-shaped keys)
        self.chunk_state: dict = {}  # key -> chunks' views of self.flat_state[key]
        self.scalars: dict = {}  # key -> (members' 0-dim tensors, their versions when last written)
        self.chunk_scalars: dict = {}  # key -> one 0-dim tensor per chunk, which the optimizer updates
        self.values: dict = {}  # key -> plain value shared by the members
        self._adopt_grads()
        first = state.get(params[0]) or {}
        for key, value in first.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                self._adopt_state(state, key, *self._flat_of([state[p][key] for p in params], self.place("state", key, value)))
            elif isinstance(value, torch.Tensor):
                members = [state[p][key] for p in params]
                self.scalars[key] = (members, [t._version for t in members])
                self.chunk_scalars[key] = [value.clone() for _ in self.chunks]
            else:
                self.values[key] = value

    # ---- before the step ------------------------------------------------------------------

    def still_valid(self, state) -> bool:
        """Whether the members are where this run left them: parameters at the same place,
        with a gradient, and state entries that are still the run's views, scalars unchanged
        since the run wrote them (a plain ``step()`` in between changes them)."""
        nkeys = len(self.state_views) + len(self.scalars) + len(self.values)
        for i, p in enumerate(self.params):
            if p.grad is None or p.data_ptr() != self._pointers[i]:
                return False
            s = state.get(p)
            if s is None or len(s) != nkeys:
                return False
            for key, views in self.state_views.items():
                if s.get(key) is not views[i]:
                    return False
            for key, (members, versions) in self.scalars.items():
                t = s.get(key)
                if t is not members[i] or t._version != versions[i]:
                    return False
            for key, value in self.values.items():
                if key not in s or not _same_value(s[key], value):
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
        """Copy gradients that are not the run's views (fresh ones, after
        ``zero_grad(set_to_none=True)``) into the flat gradient and re-point ``.grad`` there."""
        stale = [i for i, (p, v) in enumerate(zip(self.params, self.grad_views)) if p.grad is not v]
        if not stale:
            return
        torch._foreach_copy_([self.grad_views[i] for i in stale], [self.params[i].grad for i in stale])
        for i in stale:
            self.params[i].grad = self.grad_views[i]

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
            for record in (self.state_views, self.flat_state, self.chunk_state, self.scalars, self.chunk_scalars, self.values):
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

    def _write_scalar(self, state, key, value: torch.Tensor) -> None:
        members = [state[p].get(key) for p in self.params]
        if all(isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype == value.dtype and t.device == value.device
               for t in members):
            torch._foreach_copy_(members, [value] * len(members))
        else:
            members = [value.clone() for _ in self.params]
            for p, t in zip(self.params, members):
                state[p][key] = t
        self.scalars[key] = (members, [t._version for t in members])

    # ---- moving tensors into flat buffers -------------------------------------------------

    def _adopt_grads(self) -> None:
        self.flat_grad, views = self._flat_of([p.grad for p in self.params], self.place("grad", None, None))
        for p, v in zip(self.params, views):
            if p.grad is not v:
                p.grad = v
        for chunk, (a, b) in zip(self.chunks, self.bounds):
            chunk.grad = self.flat_grad[a:b]
        self.grad_views = [p.grad for p in self.params]

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
            torch._foreach_copy_(*map(list, zip(*moved)))
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
