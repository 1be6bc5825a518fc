"""``model.with_bagua(optimizers, algorithm)``: Bagua's data-parallel wrapping of a module in place.

Importing :mod:`functional_bagua.compat` gives every ``torch.nn.Module`` Bagua's methods
(``with_bagua``, ``bagua_build_params``, ``no_sync``). ``with_bagua`` makes a
:class:`BaguaDistributedDataParallel`, the engine that

1. checks that every rank wraps the same model (names, shapes and dtypes of parameters and
   buffers) with the same algorithm and optimizer layout: a ValueError on every rank otherwise,
   never a hang;
2. broadcasts rank 0's parameters, buffers (Bagua forgot these) and optimizer state (its
   ``state_dict``, hyperparameters included) to every rank, so that the replicas start equal;
3. runs the algorithm at its points of the step (:mod:`functional_bagua.compat.algorithms.base`):
   before each training forward (a forward pre-hook, which also counts
   ``bagua_train_step_counter``), at the end of each synchronized backward, and after each
   ``optimizer.step()`` (a step post-hook).

The module keeps Bagua's attributes: ``bagua_optimizers``, ``bagua_algorithm`` (the running
implementation), ``bagua_buckets``, ``bagua_train_step_counter``, ``parameters_to_ignore`` (from
``_bagua_params_and_buffers_to_ignore`` and torch's ``_ddp_params_and_buffers_to_ignore``:
``"{module_name}.{param_name}"`` names, or the names ``named_parameters()`` gives; those are
neither broadcast nor synchronized) and ``bagua_module_name``. Wrapping again (another algorithm)
detaches the previous engine first.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import optree
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from functional_bagua.compat.algorithms.base import Algorithm, AlgorithmImpl, check_hooks_run
from functional_bagua.compat.backend import CommBackend, get_backend
from functional_bagua.compat.communication import BaguaProcessGroup, to_bagua_process_group
from functional_bagua.distributed.process_group import Agreement, Group, group_src, resolve

ENGINE_ATTRIBUTE = "_bagua_engine"


class BaguaDistributedDataParallel:
    """The data-parallel engine of one wrapped module (module docstring).

    Args:
        module: the model, wrapped in place.
        optimizers: the optimizers that step its parameters.
        algorithm: an :class:`~functional_bagua.compat.algorithms.base.Algorithm`.
        process_group: ``None`` (the default group), a torch process group or a ``BaguaProcessGroup``.
        bagua_module_name: the module's name in Bagua's messages.
        gradient_as_bucket_view: let gradients live in the communication buckets (Bagua's ``do_flatten``).
        find_unused_parameters: agree across ranks on which parameters got no gradient.
        bucket_cap_mb: the gradient bucket size in MiB.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        algorithm: Algorithm,
        process_group: object = None,
        bagua_module_name: Optional[str] = None,
        gradient_as_bucket_view: bool = True,
        find_unused_parameters: bool = False,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        if not isinstance(algorithm, Algorithm):
            raise TypeError(
                f"with_bagua: algorithm must be a functional_bagua.compat.algorithms.Algorithm (e.g. "
                f"GradientAllReduceAlgorithm()), got {type(algorithm).__name__}"
            )
        self.process_group: BaguaProcessGroup = to_bagua_process_group(process_group)
        self.module = module
        self.bagua_optimizers = _checked_optimizers(module, optimizers)
        self.bagua_module_name = bagua_module_name or f"{type(module).__name__}_{id(module)}"
        self._backend = get_backend(self.bagua_module_name)  # held: get_backend keeps it while someone does
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        self.bucket_cap_mb = bucket_cap_mb
        self.parameters_to_ignore = list(getattr(module, "_bagua_params_and_buffers_to_ignore", [])) + list(
            getattr(module, "_ddp_params_and_buffers_to_ignore", [])
        )
        self.bagua_train_step_counter = 0
        self._require_sync = True
        previous = vars(module).get(ENGINE_ATTRIBUTE)
        if isinstance(previous, BaguaDistributedDataParallel):
            previous.detach()
        self._agree(algorithm)
        self.bagua_algorithm: AlgorithmImpl = algorithm.reify(self.process_group)
        check_hooks_run(self.bagua_algorithm)
        self.forward_inputs: Any = None  # the inputs of the training forward about to run (Bagua's pre-hook takes them)
        self._in_backward = False
        self._hooks: list = [module.register_forward_pre_hook(self._before_forward)]
        on_gradient = _weakly(self._on_gradient)  # see GradientReducer._hook: a strong hook kept the engine alive
        self._hooks += [p.register_post_accumulate_grad_hook(on_gradient) for _, p in self.named_parameters_to_sync()]
        self._hooks += [o.register_step_post_hook(self._after_step) for o in self.bagua_optimizers]
        # what torch's Join asks of a joinable, on the wrapped module itself (see join_hook)
        vars(module).update(
            join_hook=self._module_join_hook,
            join_device=self.join_device,
            join_process_group=self.join_process_group,
        )
        self._reset()

    # ---- what is synchronized -----------------------------------------------------------------

    def ignored(self, fqn: str, bagua_name: str) -> bool:
        """Whether a parameter or buffer is left alone (``parameters_to_ignore`` names it either way).

        Args:
            fqn: its name as ``named_parameters()`` gives it.
            bagua_name: its ``"{module_name}.{param_name}"`` name.
        """
        return fqn in self.parameters_to_ignore or bagua_name in self.parameters_to_ignore

    def named_parameters_to_sync(self) -> list[tuple[str, torch.nn.Parameter]]:
        """``(name, parameter)`` of the trainable parameters not ignored, in ``named_parameters()`` order."""
        return [
            (name, p)
            for name, p in self.module.named_parameters()
            if p.requires_grad and not self.ignored(name, _bagua_name(name))
        ]

    def bagua_build_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Bagua's list of ``("{module_name}.{param_name}", parameter)`` for the synchronized
        parameters; with ``find_unused_parameters``, after a backward, only those that got a
        gradient in it on this rank (as Bagua's)."""
        named = [(_bagua_name(name), p) for name, p in self.named_parameters_to_sync()]
        used = self.bagua_algorithm.used_in_last_backward() if self.find_unused_parameters else None
        if used is None:
            return named
        return [pair for pair, got in zip(named, used) if got]

    def named_parameters_for_hooks(self) -> list[tuple[str, torch.nn.Parameter]]:
        """``(Bagua name, parameter)`` of every trainable parameter: what Bagua's backward hook is
        called with (:mod:`~functional_bagua.compat.algorithms.base`)."""
        return [(_bagua_name(name), p) for name, p in self.module.named_parameters() if p.requires_grad]

    @property
    def bagua_buckets(self) -> list:
        """The running algorithm's buckets."""
        return self.bagua_algorithm.buckets()

    @property
    def _bagua_backend(self) -> CommBackend:
        """The model's backend (:func:`~functional_bagua.compat.backend.get_backend`), which runs
        its buckets' operations."""
        return self._backend

    def _states(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers not ignored, by name: what is broadcast from rank 0."""
        named: dict[str, torch.Tensor] = dict(self.module.named_parameters())
        named.update(dict(self.module.named_buffers()))
        return {name: t for name, t in named.items() if not self.ignored(name, _bagua_name(name))}

    # ---- the step ------------------------------------------------------------------------------

    @property
    def require_backward_grad_sync(self) -> bool:
        """``False`` inside :meth:`no_sync`: backward passes only accumulate local gradients."""
        return self._require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._require_sync = value
        self.bagua_algorithm.set_gradient_sync(value)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within the block, gradients accumulate locally; the next synchronized backward averages
        all of them (torch DDP's ``no_sync``)."""
        before = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def _before_forward(self, module: torch.nn.Module, inputs: Any) -> None:
        if module.training and torch.is_grad_enabled() and self._require_sync and "_join_config" in vars(module):
            Join.notify_join_context(module)  # type: ignore[arg-type]  # a Joinable by duck typing (torch's Join asks no more)
        if module.training:
            self.bagua_train_step_counter += 1
            vars(module)["bagua_train_step_counter"] = self.bagua_train_step_counter
        if module.training and self.bagua_algorithm.need_reset():
            self._reset()
        if module.training:
            self.forward_inputs = inputs
            self.bagua_algorithm.before_forward(self)
            self.forward_inputs = None

    def _on_gradient(self, p: torch.Tensor) -> None:
        if self._require_sync and not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._in_backward = False
        self.bagua_algorithm.after_backward(self)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.bagua_algorithm.after_step(self, optimizer)

    # ---- uneven inputs: torch's Join ---------------------------------------------------------------

    def join_hook(self, before: Optional[Callable[[], None]] = None) -> JoinHook:
        """The hook torch's ``Join`` runs on a rank that has run out of batches: each time the
        others train a step, it runs that step's collectives with zero gradients
        (``before`` first: the wrapper's buffer broadcast); when all have joined, the last rank
        to join broadcasts its parameters and buffers, as torch's DDP does."""
        algorithm = self.bagua_algorithm
        if not algorithm.supports_join:
            raise RuntimeError(
                f"torch's Join context manager: {type(algorithm).__name__} communicates weights or optimizer "
                "state, which a rank without batches cannot take part in; Join supports the gradient algorithms "
                "(gradient_allreduce, bytegrad). With the others, give every rank the same number of batches "
                "(drop_last=True), and run any extra forward pass (evaluation on one rank) in eval mode, "
                "model.eval(), whose forwards communicate nothing"
            )
        return _ShadowingJoinHook(self, before)

    def _module_join_hook(self, **kwargs: Any) -> JoinHook:
        """The wrapped module's ``join_hook`` (torch's Join calls it before reading ``join_device``,
        which is refreshed here: the module may have moved since it was wrapped)."""
        vars(self.module)["join_device"] = self.join_device
        return self.join_hook()

    def shadow_step(self) -> None:
        self.bagua_algorithm.shadow(self)  # type: ignore[attr-defined]  # supports_join: it has one

    @torch.no_grad()
    def sync_final(self, is_last_joiner: bool) -> None:
        """Every rank gets the parameters and buffers of the rank that joined last (it trained
        the most steps; the ranks that joined before it stopped updating theirs)."""
        group = self._group()
        flag = torch.tensor([group.rank if is_last_joiner else -1], device=self.join_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group.group)
        src = group_src(group, int(flag.item()))
        for tensor in self._states().values():
            dist.broadcast(tensor.data, src, group=group.group)

    @property
    def join_device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def join_process_group(self) -> Any:
        return self._group().group

    # ---- wrap time -----------------------------------------------------------------------------

    def _group(self) -> Group:
        return resolve(self.process_group.torch_group, "with_bagua")

    def _agree(self, algorithm: Algorithm) -> None:
        """Raise the same ValueError on every rank unless all wrap the same model the same way."""
        settings = dict(
            algorithm=type(algorithm).__name__,
            algorithm_arguments=_arguments_of(algorithm),
            optimizers=[[len(g["params"]) for g in o.param_groups] for o in self.bagua_optimizers],
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            find_unused_parameters=self.find_unused_parameters,
            bucket_cap_mb=self.bucket_cap_mb,
        )
        states = {name: t.detach() for name, t in self._states().items()}
        Agreement("with_bagua", settings).init(states, self._group())

    @torch.no_grad()
    def _broadcast_from_rank_0(self) -> None:
        """Rank 0's parameters, buffers and optimizer states on every rank."""
        group = self._group()
        src = group_src(group, 0)
        states = list(self._states().values())
        for tensor in states:
            dist.broadcast(tensor.data, src, group=group.group)
        device = next((t.device for t in states if t.is_cuda), None)  # NCCL needs it
        for optimizer in self.bagua_optimizers:
            if isinstance(optimizer, torch.optim.LBFGS):
                raise ValueError("with_bagua: LBFGS is not supported (its state cannot be broadcast), as in Bagua")
            # on the CPU: a pickled CUDA tensor would unpickle on rank 0's GPU on every rank
            payload = [_on_cpu(optimizer.state_dict()) if group.rank == 0 else None]
            dist.broadcast_object_list(payload, src, group=group.group, device=device)
            received = payload[0]
            if group.rank != 0 and received is not None:
                _warn_of_replaced_hyperparameters(optimizer, received["param_groups"], group.rank)
                optimizer.load_state_dict(received)

    def _reset(self) -> None:
        """Broadcast rank 0's state and (re)start the algorithm."""
        self.bagua_algorithm.detach(self)
        self._broadcast_from_rank_0()
        self.bagua_algorithm.init(self)
        self.bagua_algorithm.set_gradient_sync(self._require_sync)
        vars(self.module)["bagua_buckets"] = self.bagua_algorithm.buckets()

    def detach(self) -> None:
        """Remove every hook and stop the algorithm (the module is wrapped again)."""
        self.bagua_algorithm.detach(self)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for name in ("join_hook", "join_device", "join_process_group", "_join_config"):
            vars(self.module).pop(name, None)

    def bytes_per_step(self) -> int:
        """The bytes this rank hands to the collectives per training step (before compression)."""
        return self.bagua_algorithm.bytes_per_step(self)


def _weakly(method: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """``method`` called through a weak reference to its object (nothing once the object is gone)."""
    ref = weakref.WeakMethod(method)

    def call(p: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(p)

    return call


def _bagua_name(fqn: str) -> str:
    """Bagua's ``"{module_name}.{param_name}"`` for a ``named_parameters()`` name (``".weight"`` at the root)."""
    module_name, _, param_name = fqn.rpartition(".")
    return f"{module_name}.{param_name}"


def _checked_optimizers(module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> list:
    """``optimizers`` as a list, each a torch optimizer of parameters of ``module`` only."""
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    own = {id(p) for p in module.parameters()}
    checked = []
    for i, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"with_bagua: optimizers[{i}] is {type(optimizer).__name__}, not a torch.optim.Optimizer")
        foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
        if foreign:
            raise ValueError(
                f"with_bagua: optimizers[{i}] ({type(optimizer).__name__}) holds {foreign} parameters that are not "
                f"this {type(module).__name__}'s; pass the optimizers of the model being wrapped"
            )
        checked.append(optimizer)
    return checked


# ---- the methods every torch.nn.Module gets ------------------------------------------------------


def with_bagua(
    self: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    algorithm: Algorithm,
    process_group: object = None,
    do_flatten: bool = True,
) -> torch.nn.Module:
    """Make this module data-parallel with Bagua's ``algorithm`` (module docstring); returns the module.

    Args:
        optimizers: the optimizers that step this module's parameters.
        algorithm: an :class:`~functional_bagua.compat.algorithms.base.Algorithm`.
        process_group: ``None`` (the default group), a torch process group or a ``BaguaProcessGroup``.
        do_flatten: keep gradients in the communication buckets (no copy per step).

    Example::

        model = model.with_bagua([optimizer], GradientAllReduceAlgorithm())
    """
    name = vars(self).get("_bagua_module_name") or f"{type(self).__name__}_{id(self)}"
    engine = BaguaDistributedDataParallel(
        self, optimizers, algorithm, process_group, name, gradient_as_bucket_view=do_flatten
    )
    vars(self).update(  # plain attributes, as Bagua's
        {
            ENGINE_ATTRIBUTE: engine,
            "_bagua_module_name": name,
            "bagua_module_name": name,
            "bagua_optimizers": engine.bagua_optimizers,
            "bagua_algorithm": engine.bagua_algorithm,
            "parameters_to_ignore": engine.parameters_to_ignore,
            "bagua_train_step_counter": 0,
        }
    )
    return self


def bagua_build_params(self: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``[("{module_name}.{param_name}", parameter), ...]``: the parameters a wrapped module
    synchronizes (trainable, not ignored); before ``with_bagua``, every trainable parameter."""
    engine = vars(self).get(ENGINE_ATTRIBUTE)
    if isinstance(engine, BaguaDistributedDataParallel):
        return engine.bagua_build_params()
    return [(_bagua_name(name), p) for name, p in self.named_parameters() if p.requires_grad]


@contextlib.contextmanager
def no_sync(self: torch.nn.Module) -> Iterator[None]:
    """Within the block, backward passes of a wrapped module only accumulate local gradients."""
    engine = vars(self).get(ENGINE_ATTRIBUTE)
    if not isinstance(engine, BaguaDistributedDataParallel):
        raise RuntimeError("no_sync() needs a module wrapped with with_bagua(...) first")
    with engine.no_sync():
        yield


class _ShadowingJoinHook(JoinHook):
    """torch's ``JoinHook`` for a wrapped module (see :meth:`BaguaDistributedDataParallel.join_hook`)."""

    def __init__(self, engine: BaguaDistributedDataParallel, before: Optional[Callable[[], None]]) -> None:
        self.engine, self.before = engine, before

    def main_hook(self) -> None:
        if self.before is not None:
            self.before()
        self.engine.shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.engine.sync_final(is_last_joiner)


class BaguaModule:
    """Bagua's methods of ``torch.nn.Module``, given to it when functional_bagua.compat is
    imported (:func:`patch_torch_module`): ``model.with_bagua(optimizers, algorithm)``,
    ``model.bagua_build_params()`` and ``model.no_sync()`` (where torch's module has none)."""

    with_bagua = with_bagua
    bagua_build_params = bagua_build_params
    no_sync = no_sync


def patch_torch_module() -> None:
    """Give ``torch.nn.Module`` the methods of :class:`BaguaModule` (done once when
    functional_bagua.compat is imported)."""
    for name in ("with_bagua", "bagua_build_params"):
        setattr(torch.nn.Module, name, vars(BaguaModule)[name])
    if not hasattr(torch.nn.Module, "no_sync"):
        torch.nn.Module.no_sync = BaguaModule.no_sync  # type: ignore[attr-defined]


def _on_cpu(state: Any) -> Any:
    """``state`` with every tensor copied to the CPU (``load_state_dict`` moves them back)."""
    return optree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, state, none_is_leaf=True)


def _arguments_of(algorithm: Algorithm) -> dict:
    """The algorithm's own settings as it was built (its public attributes of plain values:
    ``peer_selection_mode``, ``communication_interval``, ``sync_interval_ms``...), compared across
    ranks: ranks that differ there would wait on different collectives."""
    return {
        k: v
        for k, v in sorted(vars(algorithm).items())
        if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None), tuple))
    }


_HYPERPARAMETER_TYPES = (bool, int, float, str, type(None), tuple)


def _warn_of_replaced_hyperparameters(optimizer: torch.optim.Optimizer, rank0_groups: list, rank: int) -> None:
    """Bagua broadcasts rank 0's optimizer state, its param groups' numbers included: a number
    this rank set otherwise is replaced, which Bagua does silently. Warn once per optimizer,
    naming each such number and both values."""
    replaced = [
        f"param group {i}'s {k}: {mine[k]!r} here, {v!r} on rank 0"
        for i, (mine, theirs) in enumerate(zip(optimizer.param_groups, rank0_groups))
        for k, v in theirs.items()
        if k != "params" and isinstance(v, _HYPERPARAMETER_TYPES) and k in mine and mine[k] != v
    ]
    if replaced:
        warnings.warn(
            f"with_bagua: rank {rank}'s {type(optimizer).__name__} was built with other numbers than rank 0's, "
            f"which replace them (as Bagua broadcasts rank 0's optimizer state): {'; '.join(replaced)}",
            stacklevel=4,
        )
