"""Small models and data shared by the tests: parameters of several shapes, random batches."""

from __future__ import annotations

import contextlib

import torch


class ShapesNet(torch.nn.Module):
    """Parameters of every common shape: 4-D conv kernel, biases, a matrix and a 0-dim scale."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, kernel_size=3)
        self.fc = torch.nn.Linear(3 * 4 * 4, 4)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1)) * self.scale


class MatrixNet(torch.nn.Module):
    """Only 2-D parameters (for Muon): two bias-free linear layers, one tall and one wide."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(2 * 6 * 6, 10, bias=False)
        self.down = torch.nn.Linear(10, 4, bias=False)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x.flatten(1))))


class NormNet(torch.nn.Module):
    """A conv net with BatchNorm: buffers (running statistics) that training updates."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, kernel_size=3, bias=False)  # BatchNorm cancels a bias
        self.norm = torch.nn.BatchNorm2d(3)
        self.fc = torch.nn.Linear(3 * 4 * 4, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.norm(self.conv(x))).flatten(1))


class DeepNet(torch.nn.Module):
    """Three linear layers: a backward long enough for communication to overlap with."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(2 * 6 * 6, 32),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 32),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 4),
        )

    def forward(self, x):
        return self.layers(x)


def make_model(kind: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """The model ``kind`` with weights drawn on the CPU from ``seed``, moved to the default device:
    the same initial weights on every device, so a CUDA run can be compared with a CPU run."""
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = {"shapes": ShapesNet, "matrix": MatrixNet, "norm": NormNet, "deep": DeepNet}[kind]()
    return model.to(dtype).to(torch.get_default_device())


def batches(n: int, dtype: torch.dtype, seed: int = 1, batch_size: int = 8):
    """``n`` random (input, target) batches, drawn on the CPU (the same numbers on every device) and
    moved to the default device."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    device = torch.get_default_device()
    return [
        (
            torch.randn(batch_size, 2, 6, 6, generator=gen, dtype=dtype, device="cpu").to(device),
            torch.randn(batch_size, 4, generator=gen, dtype=dtype, device="cpu").to(device),
        )
        for _ in range(n)
    ]


def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out, y)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch.optim keeps scalar state (steps, NAdam's mu_product, ASGD's eta) in the default dtype;
    run the reference in the dtype under test so that float64 runs are float64 throughout."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point and dtype.itemsize >= 4 else old)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def eager_and_compiled_runs(make_optimizer, steps: int, dtype: torch.dtype, graphs_after: int):
    """One model trained with ``make_optimizer(model)``'s eager ``step`` and one with
    ``torch.compile(opt.step)``, each under a StepLR halving the lr every 2 steps: the two models,
    the number of graphs compiled once step ``graphs_after`` (counting from 0) was taken, and the
    number at the end."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    runs, graphs = [], None
    for compiled in (False, True):
        model = make_model("shapes", dtype)
        opt = make_optimizer(model)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        step = torch.compile(opt.step, backend=counter) if compiled else opt.step
        for i, (x, y) in enumerate(batches(steps, dtype)):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            step()
            sched.step()
            if compiled and i == graphs_after:
                graphs = counter.frame_count
        runs.append(model)
    return runs[0], runs[1], graphs, counter.frame_count
