"""Whole training steps: forward, backward and the optimizer update as one pure function.

``make_train_step(model, loss_fn, tx)`` builds::

    step(params, state, batch) -> (params, state, loss)

    (loss, buffers'), grads = grad_and_value(loss_of)(params)     # torch.func, w.r.t. params only
    updates, state = tx.update(grads, state, params)
    params = apply_updates(params, updates)

with ``loss_of(params) = loss_fn(functional_call(model, (params, buffers), inputs), targets)``
for ``batch = (inputs, targets)``: ``loss_fn(outputs, targets)`` gets the model's output and the
batch's targets, as ``torch.nn.functional.cross_entropy`` takes them. ``inputs`` is one tensor
(``model(inputs)``), a tuple of positional arguments (``model(*inputs)``) or a dict of keyword
arguments (``model(**inputs)``). Compiled (``compile=True``, the default) the step is one
``torch.compile(fullgraph=True)`` graph: forward, backward and update fused together;
hyperparameters and schedules are tensors in ``state``, so changing them never recompiles.

Buffers (BatchNorm running statistics) are read from ``model`` and written back into it after
each step, as eager training would leave them. With ``layout`` (a :class:`~functional_bagua.FlatLayout`)
``params`` are flat buffers and ``tx`` runs fused over them (:func:`~functional_bagua.fuse`).

The fastest update kernel: for ``sgd``, ``adam`` and ``adamw`` built with number hyperparameters
(alone, or as ``chain(allreduce_gradients(...), alias)``, after the reduction), the step updates with torch's fused kernel in its functional form
(:func:`~functional_bagua.kernels.run_pure`: one pass, new tensors out; one op in a compiled
graph): eager on a ``{name: tensor}`` parameter dict or flat buffers, compiled on flat buffers.
The numbers are then those of ``torch.optim``'s ``fused=True`` (within float rounding of
``tx.update``'s). The functional form writes every result to fresh memory; an eager step built
with ``donate=True`` may instead overwrite the ``params`` and ``state`` it is given (as JAX's
``donate_argnums``) and runs the kernel in place, as ``torch.optim`` does: the same numbers,
without the fresh tensors' allocation and page faults.

A model whose parameters are DTensors (FSDP2's ``fully_shard``) gets a step that runs its
forward and backward through the model, so that FSDP2 gathers and reduce-scatters as it
schedules, and the update on the shards (:mod:`functional_bagua.sharded_step`).

Data parallel: when ``tx`` is ``chain(allreduce_gradients(...), ...)`` and the step is eager on a
parameter tree, the all-reduce runs during backward, as torch's DDP runs it: the parameters are
differentiated as autograd leaves, and a :class:`~functional_bagua.distributed.GradientReducer`
(hooks on those leaves, DDP's buckets) launches each bucket as soon as its gradients exist; the
rest of the chain then updates with the averaged gradients. The numbers are those of the chain
run after backward (bit for bit with 2 and 4 ranks; the reducer divides before summing, as DDP
does, the transform after). Compiled on a parameter tree, the step is one graph in which each
bucket's all-reduce depends only on its own gradients; inductor's communication reordering
(:data:`COMM_OVERLAP_OPTIONS`) then launches it as soon as they are computed and waits for it
only where the update reads it, so the rest of backward runs meanwhile (same numbers, a
different order). ``overlap=False`` keeps the all-reduce after backward.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from functional_bagua import kernels, ownership, tree
from functional_bagua.base import GradientTransformation, OptState, apply_updates, chain, identity
from functional_bagua.compiling import compile_own
from functional_bagua.flat import FlatLayout
from functional_bagua.fusion import fuse
from functional_bagua.sharded_step import has_dtensor_parameters, sharded_train_step
from functional_bagua.tree import PyTree

# inductor's passes that move each collective up to where its input is ready and its wait down to
# its first reader (torch._inductor.config's recommended set for compute/communication overlap)
COMM_OVERLAP_OPTIONS = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": [
        "reorder_communication_preserving_peak_memory",
        "sink_waits_iterative",
        "reorder_communication_preserving_peak_memory",
    ],
}


def make_train_step(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    tx: GradientTransformation,
    *,
    compile: Union[bool, dict] = True,
    layout: Optional[FlatLayout] = None,
    overlap: bool = True,
    donate: bool = False,
    cuda_graph: bool = False,
    graph_warmup: int = 3,
) -> Callable:
    """``step(params, state, batch) -> (params, state, loss)`` (module docstring).

    ``compile``: ``True`` for ``torch.compile(fullgraph=True)``, ``False`` for eager, or a dict
    of ``torch.compile`` keyword arguments (``{"backend": "eager"}``, ``{"mode": "max-autotune"}``).
    ``state`` comes from ``tx.init(params)`` (``fuse(tx, layout).init(flat)`` with a layout).

    Example::

        step = fb.make_train_step(model, torch.nn.functional.cross_entropy, fb.adamw(1e-3))
        params = fb.params_of(model)
        state = fb.adamw(1e-3).init(params)
        for batch in loader:
            params, state, loss = step(params, state, batch)

    Args:
        model: the module whose forward the step runs (``torch.func.functional_call`` with ``params``
            and its buffers); its buffers are read before each step and written back after it.
        loss_fn: ``loss_fn(outputs, targets)``, the loss as a 0-dim tensor; it gets the model's
            output and the batch's targets.
        tx: the optimizer whose ``update`` the step applies (fused over ``layout`` when one is given).
        compile: ``True``, ``False`` or a dict of ``torch.compile`` keyword arguments (above).
        layout: a :class:`~functional_bagua.FlatLayout`: ``params`` are then its flat buffers and ``tx``
            runs as ``fuse(tx, layout)``; ``None`` (default) for a parameter tree.
        overlap: for a step on a parameter tree whose ``tx`` is a ``chain`` starting with
            :func:`~functional_bagua.distributed.allreduce_gradients`, run that all-reduce during
            backward (module docstring): eager through gradient hooks; compiled with inductor
            (the default backend, no ``mode``) through ``COMM_OVERLAP_OPTIONS``, added to the
            ``options`` given in ``compile``. ``False`` runs it after backward, as the chain says.
        donate: let the step overwrite the ``params`` and ``state`` it is given and return them:
            eager, torch's fused kernel runs in place where it runs (module docstring), and any
            other update is copied into them; compiled, the new values are written into them
            inside the graph (inductor stores its results there). What you pass holds the new
            values after the call, and so does memory it shares (``fb.params_of(model)`` aliases
            the module's parameters, which then train along).
        cuda_graph: replay the whole step as one CUDA graph (``torch.cuda.graph``), eager or
            compiled; implies ``donate``. The first ``graph_warmup`` calls run as usual (on a
            side stream); the next one captures the step, with ``params``, ``state`` and the
            batch's tensors as the graph's fixed buffers, and every call replays it: the
            batch is copied into those buffers, the update writes into ``params`` and ``state``,
            and the loss comes back as a fresh tensor. Scheduled hyperparameters are computed
            from the step count in ``state`` inside the graph, so they change without a new
            capture. Each call must pass the ``params`` and ``state`` the previous one returned
            and a batch of the same shapes and dtypes (a ValueError otherwise). CUDA only, and
            not with a distributed ``tx`` (both a ValueError).
        graph_warmup: the calls run before the capture (cuDNN and cuBLAS choose their kernels,
            lazily built state is made); at least 1.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"make_train_step: model must be the torch.nn.Module whose forward the step runs, got "
            f"{type(model).__name__}; pass the model itself (its parameters are the step's params: fb.params_of(model))"
        )
    settings = _leading_allreduce(tx)
    if has_dtensor_parameters(model):  # FSDP2's: its hooks gather and reduce around our update
        if settings is not None or cuda_graph:
            raise ValueError(
                "make_train_step: the model's parameters are DTensors (FSDP2's), whose gradients FSDP2 reduce-"
                "scatters itself: drop allreduce_gradients from tx"
                if settings is not None
                else "make_train_step: cuda_graph=True does not capture FSDP2's collectives; pass cuda_graph=False"
            )
        return sharded_train_step(model, loss_fn, tx, compile, layout, model_arguments, check_batch)
    if cuda_graph:
        if settings is not None:
            raise ValueError(
                "make_train_step: cuda_graph=True does not capture a distributed tx (its all-reduce runs "
                "outside the graph); pass cuda_graph=False"
            )
        if graph_warmup < 1:
            raise ValueError(f"make_train_step: graph_warmup must be at least 1, got {graph_warmup}")
        donate = True
    if overlap and settings is not None and not compile and layout is None:
        return _overlapped_train_step(model, loss_fn, tx, settings, donate)
    update = (fuse(tx, layout) if layout is not None else tx).update
    to_tree = layout.unflatten if layout is not None else (lambda params: params)
    spec, reduce_first = _update_kernel(tx)
    # compiled, only on flat buffers: inside a compiled step on a parameter tree torch 2.13 gives
    # the kernel's results wrong (a 4-D convolution weight moved by 2 lr in one step); compiled and
    # donated, inductor's own kernels write the update into the buffers (the functional kernel's
    # results would be copied over once more)
    kernel = spec if spec is not None and (not compile or (layout is not None and not donate)) else None

    def loss_of(
        params: PyTree, buffers: dict[str, torch.Tensor], inputs: Any, targets: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        buffers = {k: b.clone() for k, b in buffers.items()}  # the forward may update them in place
        args, kwargs = model_arguments(inputs)
        out = torch.func.functional_call(model, (to_tree(params), buffers), args, kwargs)
        return loss_fn(out, targets), buffers

    value_and_grad = torch.func.grad_and_value(loss_of, has_aux=True)

    def pure_step(
        params: PyTree, state: OptState, batch: Any, buffers: dict[str, torch.Tensor]
    ) -> tuple[PyTree, OptState, torch.Tensor, dict[str, torch.Tensor]]:
        inputs, targets = batch
        grads, (loss, new_buffers) = value_and_grad(params, buffers, inputs, targets)
        if kernel is not None and _is_tensor_dict(params):  # torch's fused kernel
            if reduce_first:  # chain(allreduce_gradients(...), alias): reduce, then the kernel
                grads, reduced_state = tx.update.transforms[0].update(grads, state[0], params)  # type: ignore[attr-defined]
                new_params, inner = _run_kernel(kernel, grads, state[1], params, donate and not compile)
                new_state: OptState = (reduced_state, inner)
            else:
                new_params, new_state = _run_kernel(kernel, grads, state, params, donate and not compile)
        else:  # donated and eager: the state given up to the rules that compute in it (ownership module)
            with ownership.giving_state(update if donate and not compile else None):
                updates, new_state = update(grads, state, params)
            new_params = apply_updates(params, updates)
        if donate:  # the new values into the given tensors (those stepped in place already are those)
            with torch.no_grad():
                tree.copy_into((params, state), (new_params, new_state))
            new_params, new_state = params, state
        return new_params, new_state, loss.detach(), new_buffers

    if compile:
        compile_kwargs = dict(compile) if isinstance(compile, dict) else {}
        if overlap and settings is not None and layout is None:
            compile_kwargs = _with_comm_overlap(compile_kwargs)
        pure_step = compile_own(pure_step, fullgraph=True, **compile_kwargs)  # its own cache (compiling.py)

    def step(params: PyTree, state: OptState, batch: Any) -> tuple[PyTree, OptState, torch.Tensor]:
        check_batch(batch)
        buffers = dict(model.named_buffers())
        params, state, loss, new_buffers = pure_step(params, state, batch, buffers)
        with torch.no_grad():
            for name, value in new_buffers.items():
                buffers[name].copy_(value)
        return params, state, loss

    return graphed(step, graph_warmup) if cuda_graph else step


def graphed(step: Callable, warmup: int) -> Callable:
    """``step`` (a donated ``step(params, state, batch) -> (params, state, loss)``) replayed as one
    CUDA graph after ``warmup`` ordinary calls (``make_train_step``'s ``cuda_graph``)."""
    captured: dict[str, Any] = {}
    calls = [0]

    def graphed_step(params: PyTree, state: OptState, batch: Any) -> tuple[PyTree, OptState, torch.Tensor]:
        if not captured:
            _check_cuda(params)
            if calls[0] < warmup:  # on a side stream, as torch.cuda.graph's warm-up wants
                calls[0] += 1
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    out = step(params, state, batch)
                torch.cuda.current_stream().wait_stream(side)
                return out
            captured.update(params=params, state=state, batch=tree.tree_map(_static_copy, batch))
            captured["leaves"] = tree.flatten((params, state))[0]
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            try:
                with torch.cuda.graph(graph):
                    _, _, loss = step(params, state, captured["batch"])
            except Exception as e:  # what the step did that a graph cannot hold, with what to do
                captured.clear()
                raise RuntimeError(
                    f"make_train_step: capturing the step in a CUDA graph failed ({type(e).__name__}: {e}); either the "
                    "step itself fails on this batch, or some op of the model, loss or update cannot be captured (a "
                    "host sync, a copy from CPU memory): try compile=False (or True), or cuda_graph=False"
                ) from e
            captured.update(graph=graph, loss=loss)
        elif (
            params is not captured["params"]
            or state is not captured["state"]
            or not _same_leaves(tree.flatten((params, state))[0], captured["leaves"])
        ):
            raise ValueError(
                "a CUDA-graphed train step updates the params and state it captured in place: pass the ones the "
                "previous call returned, and change their values in place (state.hyperparams['lr'].fill_(x), not "
                "an assignment); to start over from others, build a new step"
            )
        else:
            _copy_batch(captured["batch"], batch)
        captured["graph"].replay()
        return params, state, captured["loss"].clone()

    return graphed_step


def _same_leaves(leaves: list, captured: list) -> bool:
    return len(leaves) == len(captured) and all(a is b for a, b in zip(leaves, captured))


def _check_cuda(params: PyTree) -> None:
    devices = {leaf.device.type for leaf in tree.flatten(params)[0] if isinstance(leaf, torch.Tensor)}
    if devices != {"cuda"}:
        raise ValueError(
            f"make_train_step: cuda_graph=True needs parameters on a CUDA device, got {sorted(devices)}; "
            "move the model with model.cuda() first, or pass cuda_graph=False"
        )


def _static_copy(leaf: Any) -> Any:
    return leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf


def _copy_batch(static: Any, batch: Any) -> None:
    """The batch's tensors into the captured graph's batch buffers: same structure, shapes and
    dtypes, or a ValueError naming the first difference."""
    static_leaves, static_spec = tree.flatten(static)
    leaves, spec = tree.flatten(batch)
    if spec != static_spec:
        raise ValueError(
            f"a CUDA-graphed train step replays the batch structure it captured ({static_spec}), got {spec}"
        )
    for i, (dst, src) in enumerate(zip(static_leaves, leaves)):
        if isinstance(dst, torch.Tensor):
            if not isinstance(src, torch.Tensor) or src.shape != dst.shape or src.dtype != dst.dtype:
                got = f"{tuple(src.shape)} {src.dtype}" if isinstance(src, torch.Tensor) else type(src).__name__
                raise ValueError(
                    f"a CUDA-graphed train step replays fixed shapes: batch leaf {i} was {tuple(dst.shape)} "
                    f"{dst.dtype} when captured, got {got} (make every batch the same size, e.g. "
                    "drop_last=True, or pad)"
                )
            dst.copy_(src, non_blocking=True)
        elif src != dst:
            raise ValueError(f"a CUDA-graphed train step captured batch leaf {i} = {dst!r}, got {src!r}")


def _run_kernel(
    kernel: kernels.KernelSpec, grads: dict, state: OptState, params: dict, donate: bool
) -> tuple[dict, OptState]:
    """The kernel's step: in place on the donated ``params`` and ``state`` (returned), else its
    functional form (new tensors)."""
    if donate:
        with torch.no_grad():
            kernels.run(kernel, grads, state, params)
        return params, state
    return kernels.run_pure(kernel, grads, state, params)


def _with_comm_overlap(compile_kwargs: dict) -> dict:
    """``torch.compile`` keyword arguments with :data:`COMM_OVERLAP_OPTIONS` added to inductor's
    ``options`` (those given win); unchanged for another backend or a ``mode`` (which torch
    does not take together with ``options``)."""
    if compile_kwargs.get("backend", "inductor") != "inductor" or compile_kwargs.get("mode") is not None:
        return compile_kwargs
    return {**compile_kwargs, "options": {**COMM_OVERLAP_OPTIONS, **compile_kwargs.get("options", {})}}


def _is_tensor_dict(params: PyTree) -> bool:
    """A flat ``{name: tensor}`` dict (parameters or flat buffers), what the fused kernel steps."""
    return isinstance(params, dict) and all(isinstance(p, torch.Tensor) for p in params.values())


def _update_kernel(tx: GradientTransformation) -> tuple[Optional[kernels.KernelSpec], bool]:
    """The fused kernel that computes ``tx``'s update, and whether the gradients are all-reduced
    first: ``(spec, False)`` for an alias with one, ``(spec, True)`` for
    ``chain(allreduce_gradients(...), alias)``, else ``(None, False)``."""
    spec = kernels.spec_of(tx)
    if kernels.runs_pure(spec):
        return spec, False
    transforms: tuple = getattr(tx.update, "transforms", ())
    if len(transforms) == 2 and _leading_allreduce(tx) is not None:
        inner = kernels.spec_of(transforms[1])
        if kernels.runs_pure(inner):
            return inner, True
    return None, False


def _leading_allreduce(tx: GradientTransformation) -> Optional[dict]:
    """The settings of the ``allreduce_gradients`` that starts ``tx`` (a ``chain``), else ``None``."""
    transforms = getattr(tx.update, "transforms", ())
    return getattr(transforms[0].update, "reducer_settings", None) if transforms else None


def _overlapped_train_step(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    tx: GradientTransformation,
    settings: dict,
    donate: bool,
) -> Callable:
    """The eager step with the leading all-reduce run during backward: the parameters are
    differentiated as fresh autograd leaves (sharing their storage), a
    :class:`~functional_bagua.distributed.GradientReducer` bound to those leaves launches each
    bucket's all-reduce as soon as its gradients exist, and the rest of the chain updates with
    the averaged gradients (the leading transform's place in the state is kept)."""
    from functional_bagua.distributed.reducer import GradientReducer

    transforms = tx.update.transforms  # type: ignore[attr-defined]
    rest = chain(identity(), *transforms[1:])  # identity: in the leading all-reduce's place (same state)
    kernel, _ = _update_kernel(tx)
    reducers: list[GradientReducer] = []  # built at the first step, on every rank at once

    def step(params: PyTree, state: OptState, batch: Any) -> tuple[PyTree, OptState, torch.Tensor]:
        check_batch(batch)
        inputs, targets = batch
        leaves, spec = tree.flatten(params)
        fresh = [p.detach().requires_grad_() for p in leaves]
        if not reducers:
            names = tree.leaf_names(spec)
            reducers.append(GradientReducer(list(zip(names, fresh)), gradient_as_bucket_view=False, **settings))
        else:
            reducers[0].bind(fresh)
        buffers = dict(model.named_buffers())
        copies = {k: b.clone() for k, b in buffers.items()}  # the forward may update them in place
        args, kwargs = model_arguments(inputs)
        with torch.enable_grad():
            out = torch.func.functional_call(model, (spec.unflatten(fresh), copies), args, kwargs)  # type: ignore[arg-type]
            loss = loss_fn(out, targets)
            loss.backward()  # the reducer all-reduces the buckets as they fill
        grads = spec.unflatten([leaf.grad for leaf in fresh])
        with torch.no_grad():
            for name, value in copies.items():
                buffers[name].copy_(value)
        if kernel is not None and _is_tensor_dict(params):  # the alias's fused kernel
            new_params, inner = _run_kernel(kernel, dict(grads), state[1], params, donate)
            return new_params, (state[0], inner), loss.detach()
        updates, state = rest.update(grads, state, params)
        return apply_updates(params, updates), state, loss.detach()

    return step


def model_arguments(inputs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for the model: a tuple is positional arguments, a dict keyword arguments,
    anything else the single argument.

    Args:
        inputs: the first item of a batch: a tuple, a dict, or a single value (e.g. a tensor).
    """
    if isinstance(inputs, dict):
        return (), inputs
    return (inputs if isinstance(inputs, tuple) else (inputs,)), {}


def check_batch(batch: object) -> None:
    """Raise naming the fix unless ``batch`` is a pair ``(inputs, targets)``.

    Args:
        batch: what the step was given as its batch: a tuple or list of two items passes.

    Raises:
        TypeError: for a dict, for anything that is not a tuple or list, or for one of another length.
    """
    if isinstance(batch, dict) or not isinstance(batch, (tuple, list)) or len(batch) != 2:
        got = f"a dict with keys {sorted(batch)}" if isinstance(batch, dict) else f"a {type(batch).__name__}"
        if isinstance(batch, (tuple, list)):
            got += f" of {len(batch)} items"
        raise TypeError(
            f"make_train_step: batch is {got}; pass (inputs, targets), where inputs is a tensor, a tuple of the "
            "model's positional arguments or a dict of its keyword arguments, and loss_fn(outputs, targets) "
            "computes the loss"
        )
