"""Bagua's tensor methods: what Bagua's algorithm interface calls on the tensors it communicates.

Importing :mod:`functional_bagua.compat` gives every ``torch.Tensor`` the methods of
:class:`BaguaTensor`, as Bagua's import does. A tensor becomes a *proxy* with
:meth:`BaguaTensor.ensure_bagua_tensor`; the tensor actually communicated, the *effective* tensor,
is ``getter_closure(proxy)`` (a parameter's gradient: ``lambda p: p.grad``), read anew each time,
so that a gradient replaced between steps is still the one communicated. ``setter_closure``
replaces the effective tensor (a bucket that flattens its tensors uses it).

A proxy marked ready (:meth:`BaguaTensor.bagua_mark_communication_ready`) tells its model's
backend (:func:`~functional_bagua.compat.backend.get_backend`), which runs the operations of the
proxy's bucket (:mod:`functional_bagua.compat.bucket`) once every tensor of the bucket is ready.
Here the operations run at once, on the current stream, so the CUDA event Bagua records with each
mark is not needed: the marks with and without synchronization are the same.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from functional_bagua.compat.backend import get_backend

__all__ = ["BackendTensor", "BaguaTensor", "patch_torch_tensor"]

Getter = Callable[[torch.Tensor], torch.Tensor]
Setter = Callable[[torch.Tensor, torch.Tensor], None]


class BackendTensor:
    """What Bagua's backend holds of a proxy (``proxy.bagua_backend_tensor()``): its name, and
    its effective tensor's address and size, read anew on each call.

    Args:
        name: the proxy's ``bagua_tensor_name``.
        proxy: the proxy tensor.
    """

    def __init__(self, name: str, proxy: Any) -> None:
        self.name, self.proxy = name, proxy

    def data_ptr(self) -> int:
        """The effective tensor's address."""
        return self.proxy.bagua_getter_closure().data_ptr()

    def num_elements(self) -> int:
        """The effective tensor's number of elements."""
        return self.proxy.bagua_getter_closure().numel()

    def num_elements_allocated(self) -> int:
        """The effective tensor's number of elements (no padding is allocated here)."""
        return self.num_elements()


class BaguaTensor:
    """The methods Bagua adds to ``torch.Tensor`` (module docstring); :func:`patch_torch_tensor`
    installs them, and importing :mod:`functional_bagua.compat` calls it.

    Example::

        >>> import torch, functional_bagua.compat
        >>> p = torch.nn.Parameter(torch.ones(2)).bagua_ensure_grad()
        >>> p.ensure_bagua_tensor("w", getter_closure=lambda t: t.grad).bagua_getter_closure()
        tensor([0., 0.])
    """

    def _bagua_sanity_check(self: Any) -> None:
        backend_tensor = self.bagua_backend_tensor()
        effective = self.bagua_getter_closure()
        if not isinstance(effective, torch.Tensor):
            raise ValueError(
                f"Bagua tensor {self.bagua_tensor_name!r}: its getter_closure gave {type(effective).__name__}, not a "
                "tensor (a gradient not made yet? call param.bagua_ensure_grad() first)"
            )
        if backend_tensor.data_ptr() != effective.data_ptr() or backend_tensor.num_elements() != effective.numel():
            raise RuntimeError(
                f"Bagua tensor {self.bagua_tensor_name!r}: its backend tensor is not its effective tensor"
            )

    def is_bagua_tensor(self: Any) -> bool:
        """Whether :meth:`ensure_bagua_tensor` made this tensor a proxy."""
        return hasattr(self, "_bagua_backend_tensor")

    def ensure_bagua_tensor(
        self: Any,
        name: Optional[str] = None,
        module_name: Optional[str] = None,
        getter_closure: Optional[Getter] = None,
        setter_closure: Optional[Setter] = None,
    ) -> torch.Tensor:
        """Make this tensor a proxy, in place, and return it.

        Args:
            name: the tensor's name, unique within its model.
            module_name: the model's ``bagua_module_name``; needed to mark the tensor ready.
            getter_closure: the effective tensor of a proxy (``None``: the proxy itself).
            setter_closure: replaces a proxy's effective tensor (``None``: it cannot be replaced;
                needs ``getter_closure``).
        """
        if self.is_bagua_tensor():
            if name is not None and name != self.bagua_tensor_name:
                raise ValueError(
                    f"ensure_bagua_tensor: this tensor is Bagua tensor {self.bagua_tensor_name!r} already; "
                    f"it cannot be renamed {name!r}"
                )
            if name is not None and module_name != self.bagua_module_name:
                raise ValueError(
                    f"ensure_bagua_tensor: Bagua tensor {name!r} belongs to module "
                    f"{self.bagua_module_name!r} already, not {module_name!r}"
                )
            if getter_closure is self._bagua_getter_closure and setter_closure is self._bagua_setter_closure:
                return self
        if setter_closure is not None and getter_closure is None:
            raise ValueError("ensure_bagua_tensor: a setter_closure needs a getter_closure")
        tensor_name = name if name is not None else ""
        self.bagua_tensor_name = tensor_name
        self.bagua_module_name = module_name
        self.bagua_backend = get_backend(module_name) if module_name is not None else None
        self._bagua_getter_closure = getter_closure
        self._bagua_setter_closure = setter_closure
        self._bagua_backend_tensor = BackendTensor(tensor_name, self)
        self._bagua_sanity_check()
        self._bagua_ready_event = None  # the operations run on the current stream
        self._bagua_bucket = None
        return self

    def to_bagua_tensor(
        self: Any,
        name: Optional[str] = None,
        module_name: Optional[str] = None,
        getter_closure: Optional[Getter] = None,
        setter_closure: Optional[Setter] = None,
    ) -> torch.Tensor:
        """A new proxy sharing this tensor's storage (:meth:`ensure_bagua_tensor` on a view).

        Args:
            name: the tensor's name, unique within its model.
            module_name: the model's ``bagua_module_name``.
            getter_closure: see :meth:`ensure_bagua_tensor`.
            setter_closure: see :meth:`ensure_bagua_tensor`.
        """
        return self.view(self.dtype).ensure_bagua_tensor(name, module_name, getter_closure, setter_closure)

    def bagua_getter_closure(self: Any) -> torch.Tensor:
        """The effective tensor (module docstring)."""
        getter = self._bagua_getter_closure
        return self if getter is None else getter(self)

    def bagua_setter_closure(self: Any, tensor: torch.Tensor) -> None:
        """Make ``tensor`` the effective tensor.

        Args:
            tensor: the new effective tensor.
        """
        setter = self._bagua_setter_closure
        if setter is None:
            raise RuntimeError(
                f"Bagua tensor {self.bagua_tensor_name!r} has no setter_closure: its effective tensor cannot "
                "be replaced (pass one to ensure_bagua_tensor)"
            )
        setter(self, tensor)

    def bagua_backend_tensor(self: Any) -> BackendTensor:
        """What the backend holds of this proxy (:class:`BackendTensor`)."""
        return self._bagua_backend_tensor

    def bagua_ensure_grad(self: Any) -> torch.Tensor:
        """Give a parameter without a gradient a zero one; returns the tensor."""
        if self.grad is not None:
            return self
        if not isinstance(self, torch.nn.Parameter):
            raise TypeError("bagua_ensure_grad: only a torch.nn.Parameter without a gradient gets a zero one")
        with torch.no_grad():
            self.grad = torch.zeros_like(self.data)
        return self

    def bagua_mark_communication_ready(self: Any) -> None:
        """Tell the backend this tensor is ready: its bucket's operations run once every tensor
        of the bucket is (module docstring)."""
        backend = self.bagua_backend
        if backend is None:
            raise RuntimeError(
                f"Bagua tensor {self.bagua_tensor_name!r} was made without a module_name, so no backend "
                "runs its operations: pass module_name=ddp.bagua_module_name to ensure_bagua_tensor"
            )
        backend.mark_communication_ready(self.bagua_backend_tensor(), None)

    def bagua_mark_communication_ready_without_synchronization(self: Any) -> None:
        """:meth:`bagua_mark_communication_ready` (the same here: module docstring)."""
        self.bagua_mark_communication_ready()

    def bagua_set_storage(self: Any, storage: torch.UntypedStorage, storage_offset: int = 0) -> None:
        """Make the effective tensor a view of ``storage`` from ``storage_offset`` (in elements),
        with the storage's values (Bagua's semantics): in place where there is no setter, else a
        new tensor through the setter.

        Args:
            storage: the storage (a flat bucket's).
            storage_offset: where the tensor starts in it, in elements.
        """
        effective = self.bagua_getter_closure()
        with torch.no_grad():
            stride = contiguous_stride(effective.shape)
            if self._bagua_setter_closure is None:
                effective.set_(storage, storage_offset, effective.shape, stride)
                return
            moved = effective.new_empty(0).set_(storage, storage_offset, effective.shape, stride)
            self.bagua_setter_closure(moved)


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (in elements)."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


METHODS = [name for name in vars(BaguaTensor) if "bagua" in name]


def patch_torch_tensor() -> None:
    """Give ``torch.Tensor`` the methods of :class:`BaguaTensor` (every name with ``bagua`` in it,
    as Bagua's patch)."""
    for name in METHODS:
        setattr(torch.Tensor, name, vars(BaguaTensor)[name])
