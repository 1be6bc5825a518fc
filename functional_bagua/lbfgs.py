"""L-BFGS, as torch.optim.LBFGS: one update runs up to ``max_iter`` quasi-Newton iterations, each
evaluating the loss through ``value_fn`` (what torch's ``closure`` does), with a fixed step or the
strong Wolfe line search (:mod:`functional_bagua.linesearch`).

All parameters are handled as one flat vector ``x`` (complex ones as pairs of reals). With the
last ``m`` pairs ``s_i = x_{i+1} - x_i``, ``y_i = g_{i+1} - g_i`` (a pair is kept only when
``y.s > 1e-10``), ``rho_i = 1 / (y_i.s_i)`` and ``gamma = y.s / y.y`` of the newest pair, the
direction ``d = -H g`` comes from the two-loop recursion (Nocedal & Wright, Algorithm 7.4)::

    q = -g;   for i = newest .. oldest:  a_i = rho_i s_i.q,  q <- q - a_i y_i
    r = gamma q;   for i = oldest .. newest:  b = rho_i y_i.r,  r <- r + (a_i - b) s_i;   d = r

(``d = -g`` on the very first iteration), and ``x <- x + t d`` with ``t = lr`` (on the very first
iteration ``t = min(1, 1 / |g|_1) lr``) or the step the line search finds. An update stops early
when ``max |g| <= tolerance_grad``, when ``g.d > -tolerance_change``, when ``max |t d|`` or the
change of the loss is below ``tolerance_change``, or after ``max_eval`` evaluations.

The history, last direction and step live in the state, so consecutive updates continue one
another as consecutive ``LBFGS.step(closure)`` calls do. The updates of float32 (and narrower)
parameters are float64, so that ``apply_updates`` gives the new parameters exactly. The control flow depends on values
(``if y.s > 1e-10``, the line search): the update runs eagerly; ``value_fn`` may be compiled.

Example::

    tx = fb.lbfgs(lr=1.0, line_search_fn="strong_wolfe")
    state = tx.init(params)
    loss_of = lambda p: loss_fn(torch.func.functional_call(model, p, (x,)), y)
    grads, value = torch.func.grad_and_value(loss_of)(params)
    updates, state = tx.update(grads, state, params, value_fn=loss_of, value=value)
    params = fb.apply_updates(params, updates)
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, cast

import torch

from functional_bagua import tree
from functional_bagua.base import GradientTransformation, check_params
from functional_bagua.linesearch import Point, Scalar, strong_wolfe
from functional_bagua.tree import PyTree

LINE_SEARCHES = (None, "strong_wolfe")
CURVATURE_MIN = 1e-10  # a pair (s, y) enters the history only when y.s exceeds this
# History rows start at multiples of this many bytes, as a fresh allocation does: CPU dot products
# round differently depending on where a vector starts (measured: a float32 dot of 13 elements
# changes its last bit when its start moves by 4 bytes), and torch's LBFGS keeps each pair in a
# tensor of its own.
ROW_ALIGN_BYTES = 64


class LbfgsState(NamedTuple):
    """``func_evals`` and ``n_iter``: loss evaluations and iterations in all; ``d``, ``t``: the last
    direction and step; ``dirs``, ``steps``, ``rho``: the kept pairs' ``y``, ``s`` and ``1 / y.s``,
    oldest first, in fixed-size buffers of which the first ``kept`` rows count (each row padded to
    ``ROW_ALIGN_BYTES``, see ``_row_length``); ``h_diag``: the
    scale ``gamma``; ``prev_grad``, ``prev_loss``: the gradient and loss where ``d`` started."""

    func_evals: torch.Tensor
    n_iter: torch.Tensor
    d: torch.Tensor
    t: torch.Tensor
    dirs: torch.Tensor
    steps: torch.Tensor
    rho: torch.Tensor
    kept: torch.Tensor
    h_diag: torch.Tensor
    prev_grad: torch.Tensor
    prev_loss: torch.Tensor


class _Settings(NamedTuple):
    """The arguments of :func:`lbfgs`, as one update reads them."""

    lr: float
    max_iter: int
    max_eval: int
    tolerance_grad: float
    tolerance_change: float
    history_size: int
    line_search_fn: Optional[str]


class _Flat:
    """All leaves of a parameter tree as one real vector, and back (differentiably)."""

    def __init__(self, params: PyTree) -> None:
        leaves, self.spec = tree.flatten(params)
        kinds = {(p.dtype.to_real() if p.is_complex() else p.dtype, p.device) for p in leaves}
        if len(kinds) != 1:
            raise ValueError(
                f"lbfgs: all parameters must share one (real) dtype and device, as torch.optim.LBFGS needs; got {sorted(map(str, kinds))}"
            )
        self.leaves = leaves
        self.sizes = [2 * p.numel() if p.is_complex() else p.numel() for p in leaves]

    def vector(self, leaves: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([(torch.view_as_real(t) if t.is_complex() else t).reshape(-1) for t in leaves])

    def tree(self, x: torch.Tensor) -> PyTree:
        pieces = []
        for piece, p in zip(torch.split(x, self.sizes), self.leaves):
            pieces.append(torch.view_as_complex(piece.view(*p.shape, 2)) if p.is_complex() else piece.view(p.shape))
        return self.spec.unflatten(pieces)


def lbfgs(
    lr: float = 1.0,
    max_iter: int = 20,
    max_eval: Optional[int] = None,
    tolerance_grad: float = 1e-7,
    tolerance_change: float = 1e-9,
    history_size: int = 100,
    line_search_fn: Optional[str] = None,
) -> GradientTransformation:
    """L-BFGS with torch.optim.LBFGS's arguments, defaults and numbers (module docstring).

    ``update(grads, state, params, *, value_fn, value=None)``: ``grads`` and ``value`` are the
    gradient and loss at ``params`` (``value`` is computed when not given), ``value_fn(params)``
    returns the loss at other parameters (a tensor; its gradient is taken with torch.func).

    Args:
        lr: the step along each direction (with a line search, its first trial step).
        max_iter: iterations per update.
        max_eval: loss evaluations per update (default ``max_iter * 5 // 4``).
        tolerance_grad: stop when the largest gradient element is at most this.
        tolerance_change: stop when a step, or the change of the loss, is smaller than this.
        history_size: how many pairs ``(s, y)`` are kept.
        line_search_fn: ``None`` (fixed step ``lr``) or ``"strong_wolfe"``.

    Returns:
        A GradientTransformation whose ``update`` takes ``value_fn`` (it cannot be chained).
    """
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= float(lr):
        raise ValueError(f"Invalid learning rate: {lr}")
    if line_search_fn not in LINE_SEARCHES:
        raise ValueError(f"lbfgs: line_search_fn must be one of {LINE_SEARCHES}, got {line_search_fn!r}")
    if not isinstance(history_size, int) or history_size < 1:
        raise ValueError(f"lbfgs: history_size must be an int >= 1, got {history_size!r}")
    max_eval = max_iter * 5 // 4 if max_eval is None else max_eval
    settings = _Settings(float(lr), max_iter, max_eval, tolerance_grad, tolerance_change, history_size, line_search_fn)

    def init(params: PyTree) -> LbfgsState:
        check_params(params, "lbfgs")
        x = _Flat(params).vector(tree.flatten(params)[0])
        count = torch.zeros((), dtype=torch.int64, device=x.device)
        scalar = torch.zeros((), dtype=torch.float64, device=x.device)
        history = x.new_zeros(history_size, _row_length(x))
        return LbfgsState(
            count,
            count.clone(),
            torch.zeros_like(x),
            scalar,
            history,
            history.clone(),
            x.new_zeros(history_size),
            count.clone(),
            x.new_ones(()),
            torch.zeros_like(x),
            scalar.clone(),
        )

    def update(
        grads: PyTree,
        state: LbfgsState,
        params: Optional[PyTree] = None,
        *,
        value_fn: Optional[Callable[[PyTree], torch.Tensor]] = None,
        value: Optional[Scalar] = None,
    ) -> tuple[PyTree, LbfgsState]:
        if params is None or value_fn is None:
            raise ValueError(
                "lbfgs evaluates the loss along its search: call update(grads, state, params, value_fn=loss_of), "
                "with loss_of(params) the loss (lbfgs runs on its own, not inside chain)"
            )
        flat = _Flat(params)
        grad_leaves = tree.leaves_matching(flat.spec, grads, "grads", "params")
        x0 = flat.vector(flat.leaves)
        grad = flat.vector([torch.zeros_like(p) if g is None else g for g, p in zip(grad_leaves, flat.leaves)])
        loss = float(value_fn(params) if value is None else value)

        def evaluate(x: torch.Tensor) -> tuple[float, torch.Tensor]:
            g, f = torch.func.grad_and_value(lambda v: value_fn(flat.tree(v)))(x)
            return float(f), g.detach()

        x, state = _iterations(evaluate, x0, loss, grad, state, settings)
        updates = [_exact_difference(new, old) for new, old in zip(tree.flatten(flat.tree(x))[0], flat.leaves)]
        return flat.spec.unflatten(updates), state

    return GradientTransformation(init, update)


def _iterations(
    evaluate: Callable[[torch.Tensor], tuple[float, torch.Tensor]],
    x: torch.Tensor,
    loss: float,
    grad: torch.Tensor,
    s: LbfgsState,
    settings: _Settings,
) -> tuple[torch.Tensor, LbfgsState]:
    """The iterations of one update, from ``x`` (loss ``loss``, gradient ``grad``): the new ``x``
    and state."""
    lr, max_iter, max_eval, tolerance_grad, tolerance_change, history_size, line_search_fn = settings
    func_evals, n_iter = int(s.func_evals) + 1, int(s.n_iter)
    if grad.abs().max() <= tolerance_grad:  # already optimal
        return x, tree.replaced(s, func_evals=torch.full_like(s.func_evals, func_evals))
    d, h_diag, kept = s.d, s.h_diag, int(s.kept)
    t: Scalar = s.t  # a tensor or a Python float, as in torch.optim.LBFGS
    dirs, steps, rho = s.dirs, s.steps, s.rho
    prev_grad, prev_loss = s.prev_grad, float(s.prev_loss)
    current_evals = 1
    for iteration in range(1, max_iter + 1):
        n_iter += 1
        if n_iter == 1:
            d, kept, h_diag = grad.neg(), 0, torch.ones_like(s.h_diag)
        else:
            y, step = grad.sub(prev_grad), d.mul(t)
            ys = y.dot(step)
            if ys > CURVATURE_MIN:
                dirs, steps, rho, kept = _remember(dirs, steps, rho, kept, y, step, 1.0 / ys, history_size)
                h_diag = ys / y.dot(y)
            n = grad.numel()
            d = _two_loop(grad, dirs[:kept, :n], steps[:kept, :n], rho[:kept], h_diag)
        prev_grad, prev_loss = grad, loss
        t = cast(Scalar, min(1.0, 1.0 / grad.abs().sum())) * lr if n_iter == 1 else lr
        gtd = grad.dot(d)
        if gtd > -tolerance_change:
            break
        if line_search_fn == "strong_wolfe":
            # torch.optim.LBFGS leaves the line search's own tolerance_change at its default
            along_d = functools.partial(_evaluate_along, evaluate, x, d)
            loss, grad, t, evals = strong_wolfe(
                along_d, t, d, Point(0, loss, grad, gtd), max_ls=max_eval - current_evals
            )
            x = x.add(d, alpha=t)
        else:
            x, evals = x.add(d, alpha=t), 0
            if iteration != max_iter:
                loss, grad = evaluate(x)
                evals = 1
        current_evals += evals
        func_evals += evals
        if (
            iteration == max_iter
            or current_evals >= max_eval
            or grad.abs().max() <= tolerance_grad
            or d.mul(t).abs().max() <= tolerance_change
            or abs(loss - prev_loss) < tolerance_change
        ):
            break
    return x, LbfgsState(
        torch.full_like(s.func_evals, func_evals),
        torch.full_like(s.n_iter, n_iter),
        d,
        torch.as_tensor(t, dtype=torch.float64, device=d.device).clone(),
        dirs,
        steps,
        rho,
        torch.full_like(s.kept, kept),
        torch.as_tensor(h_diag, dtype=d.dtype, device=d.device).clone(),
        prev_grad,
        torch.full_like(s.prev_loss, prev_loss),
    )


def _exact_difference(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new - old`` such that ``apply_updates`` lands on ``new`` exactly, as torch's in-place steps
    do: below float64 it is formed in float64, where the difference of two float32 (or bfloat16)
    numbers is exact and ``old + (new - old)`` rounds back to ``new``."""
    if old.element_size() < (16 if old.is_complex() else 8):
        wide = torch.complex128 if old.is_complex() else torch.float64
        return new.to(wide) - old.to(wide)
    return new - old


def _evaluate_along(evaluate: Callable, x: torch.Tensor, d: torch.Tensor, t: Scalar) -> tuple:
    """The loss and gradient at ``x + t d``."""
    return evaluate(x.add(d, alpha=t))


def _remember(
    dirs: torch.Tensor,
    steps: torch.Tensor,
    rho: torch.Tensor,
    kept: int,
    y: torch.Tensor,
    step: torch.Tensor,
    new_rho: torch.Tensor,
    history_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The history with the pair ``(y, step)`` appended (the oldest dropped when full)."""
    if kept == history_size:  # roll makes new buffers with the oldest pair last, to be overwritten
        dirs, steps, rho, kept = dirs.roll(-1, 0), steps.roll(-1, 0), rho.roll(-1, 0), kept - 1
    else:
        dirs, steps, rho = dirs.clone(), steps.clone(), rho.clone()
    n = y.numel()
    dirs[kept, :n], steps[kept, :n], rho[kept] = y, step, new_rho
    return dirs, steps, rho, kept + 1


def _row_length(x: torch.Tensor) -> int:
    """Elements per history row: ``x.numel()`` rounded up so that every row starts at a multiple
    of :data:`ROW_ALIGN_BYTES` (the padding stays zero and is never read)."""
    per_row = max(1, ROW_ALIGN_BYTES // x.element_size())
    return -(-x.numel() // per_row) * per_row


def _two_loop(
    grad: torch.Tensor, dirs: torch.Tensor, steps: torch.Tensor, rho: torch.Tensor, h_diag: torch.Tensor
) -> torch.Tensor:
    """``-H grad`` by the two-loop recursion over the kept pairs (module docstring)."""
    q = grad.neg()
    alphas: list = [None] * len(dirs)
    for i in reversed(range(len(dirs))):
        alphas[i] = steps[i].dot(q) * rho[i]
        q = q.add(dirs[i], alpha=-alphas[i])
    r = torch.mul(q, h_diag)
    for i in range(len(dirs)):
        beta = dirs[i].dot(r) * rho[i]
        r = r.add(steps[i], alpha=alphas[i] - beta)
    return r
