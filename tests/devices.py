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
    once; a fresh process a test starts calls it again)."""
    if device.type == "cpu":
        return
    torch.set_default_device(device)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def seeded(seed: int) -> torch.Generator:
    """A generator seeded with ``seed`` on the current default device (CPU inside spawned ranks)."""
    return torch.Generator(device=torch.get_default_device()).manual_seed(seed)
