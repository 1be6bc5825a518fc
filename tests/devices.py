"""The device the tests run on, and random generators on it.

``FB_TEST_DEVICE=cuda python -m pytest`` (or ``python -m pytest --device cuda``) makes that device
torch's default device for the whole run (tests/conftest.py), so every model, batch and tensor the
tests build lands there, and each test compares against torch.optim on that same device. Random
data comes from a generator on the default device: a CPU generator cannot draw CUDA tensors.
"""

from __future__ import annotations

import os

import torch

DEVICE = torch.device(os.environ.get("FB_TEST_DEVICE", "cpu"))
ON_CUDA = DEVICE.type == "cuda"


def use_device(device: torch.device = DEVICE) -> None:
    """Make ``device`` torch's default device, with TF32 and cuDNN's nondeterministic kernels off
    on CUDA, so that runs compared bit for bit do the same arithmetic (the test session calls this
    once; a fresh process a test starts calls it again). On the CPU, the worker threads are
    warmed up first (:func:`warm_up_cpu_threads`)."""
    if device.type == "cpu":
        warm_up_cpu_threads()
        return
    torch.set_default_device(device)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def warm_up_cpu_threads() -> None:
    """One parallel square root over a large tensor. The first one in a process (torch 2.13,
    this CPU) sometimes gives other bits on the part a worker thread computes (up to thousands
    of ulps; about one process in four); every later one agrees. Warmed up, the tests that
    compare two runs bit for bit do not depend on which of them runs first."""
    torch.rand(1 << 16).add_(1.0).sqrt()


def seeded(seed: int) -> torch.Generator:
    """A generator seeded with ``seed`` on the current default device (CPU inside spawned ranks)."""
    return torch.Generator(device=torch.get_default_device()).manual_seed(seed)


def at(dtype_name: str) -> str:
    """The key of a flat buffer of ``dtype_name`` on the default device, as FlatLayout names it
    (``"float32@cpu"``, ``"float32@cuda:0"``)."""
    return f"{dtype_name}@{torch.empty(0).device}"


def reduction_tolerance(dtype: torch.dtype) -> dict:
    """assert_close's tolerance for a per-tensor norm computed over a flat buffer's segments against
    the same norm of the tensor alone: exact on the CPU (the same vector_norm per tensor); on CUDA
    torch's multi-tensor norm and its single-tensor norm are different reduction kernels, whose
    sums round differently in the last bits."""
    if DEVICE.type == "cpu":
        return dict(rtol=0, atol=0)
    return dict(rtol=8 * torch.finfo(dtype).eps, atol=8 * torch.finfo(dtype).eps)
