"""fb.Optimizer in Lightning: ``configure_optimizers`` returns a functional_bagua chain wrapped as a
``torch.optim.Optimizer``, with a torch lr scheduler stepped every batch.

    pip install -e '.[integrations]' && python examples/lightning_train.py [--steps 60]

A small regression MLP on CPU (seconds). The script prints the training loss every few steps
from its own callback and, at the end, the learning rate the scheduler left in the optimizer's
param group (the value fb.Optimizer's next step would use).
"""

from __future__ import annotations

import argparse

import lightning
import torch

import functional_bagua as fb


class Regression(lightning.LightningModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.steps = steps
        self.losses: list[float] = []

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        if batch_idx % max(1, self.steps // 6) == 0:
            print(f"step {batch_idx:3d}  loss {loss.item():.4f}")
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = fb.Optimizer(self.net.parameters(), fb.adamw, lr=3e-2, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def data(steps: int) -> list:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=gen)
    batches = []
    for _ in range(steps):
        x = torch.randn(32, 8, generator=gen)
        batches.append((x, torch.tanh(x @ w) + 0.05 * torch.randn(32, 1, generator=gen)))
    return batches


def main(steps: int = 60) -> list[float]:
    module = Regression(steps)
    trainer = lightning.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data(steps), batch_size=None))
    optimizer = trainer.optimizers[0]
    print(f"trained {len(module.losses)} steps with {type(optimizer).__module__}.{type(optimizer).__name__}")
    print(f"loss: first {module.losses[0]:.4f}, last {module.losses[-1]:.4f}")
    print(f"lr in the param group after the cosine schedule: {optimizer.param_groups[0]['lr']:.2e}")
    return module.losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    main(parser.parse_args().steps)
