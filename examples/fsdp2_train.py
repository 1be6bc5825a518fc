"""A small transformer sharded with FSDP2 (``fully_shard``), trained by ``fb.make_train_step``
with AdamW fused over the flat buffers of each rank's local shards: the optimizer state stays sharded.

    torchrun --nproc-per-node 2 examples/fsdp2_train.py
    torchrun --nproc-per-node 4 examples/fsdp2_train.py --steps 50 --dtype float32

Runs on CPU with gloo (NCCL when CUDA is available). ``fb.FlatLayout.of`` of the model's DTensor
parameters lays out their local shards (``"float32@cpu:shard0"``); the step runs forward and
backward through the model (FSDP2 gathers the parameters and reduce-scatters the gradients), the
fused update on the shards (torch's fused AdamW kernel, in place) and writes the new values into
them. Each rank prints the bytes of its optimizer state next to what the whole model's state
takes; at the end the script compares the parameters with FSDP2 + ``torch.optim.AdamW`` run on
the same batches and says how far apart they are. In float64 (the default here) that is rounding
alone (about 1e-12); in float32 Adam's division by small second moments lets the two roundings
drift further apart over the steps.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import functional_bagua as fb


def make_model(device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True) for _ in range(2)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(32, 1)).to(device, dtype)


def shard(model: torch.nn.Module) -> torch.nn.Module:
    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


def batches(steps: int, rank: int, device: torch.device, dtype: torch.dtype):
    """Each rank its own part of every global batch: sequences of 8 tokens of width 32; the target
    is the sine of their mean."""
    gen = torch.Generator().manual_seed(1 + rank)
    for _ in range(steps):
        x = torch.randn(16, 8, 32, generator=gen, dtype=dtype)
        yield x.to(device), torch.sin(x.mean(dim=(1, 2), keepdim=False) * 4).unsqueeze(-1).to(device)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return mse(model(x), y)


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of the model's outputs (one per token) against each sequence's target."""
    return torch.nn.functional.mse_loss(outputs.mean(dim=1), targets)


def train_fused(steps: int, rank: int, device: torch.device, dtype: torch.dtype, lr: float) -> tuple:
    model = shard(make_model(device, dtype))
    tx = fb.adamw(lr, weight_decay=0.01)
    layout = fb.FlatLayout.of(fb.params_of(model))  # each rank's local shards
    params = layout.flatten(fb.params_of(model))
    state = fb.fuse(tx, layout).init(params)
    step = fb.make_train_step(model, mse, tx, layout=layout)  # FSDP2's collectives, our update on the shards
    losses = []
    for batch in batches(steps, rank, device, dtype):
        params, state, loss = step(params, state, batch)
        losses.append(loss.item())
    state_bytes = sum(t.nbytes for t in fb.tree.flatten(state)[0] if isinstance(t, torch.Tensor))
    return model, losses, state_bytes


def train_torch(steps: int, rank: int, device: torch.device, dtype: torch.dtype, lr: float) -> torch.nn.Module:
    model = shard(make_model(device, dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    for x, y in batches(steps, rank, device, dtype):
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, losses, state_bytes = train_fused(args.steps, rank, device, dtype, args.lr)
    whole = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # AdamW's two moments, unsharded
    print(
        f"rank {rank}: optimizer state {state_bytes / 1024:.1f} KiB on this rank, {whole / 1024:.1f} KiB for the "
        f"whole model ({state_bytes / whole:.2f} of it on {world} ranks)",
        flush=True,
    )
    reference = train_torch(args.steps, rank, device, dtype, args.lr)
    apart = max(
        (p.full_tensor() - q.full_tensor()).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters())
    )
    if rank == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} (rank 0's part of the batch) in {args.steps} steps")
        print(f"largest difference from FSDP2 + torch.optim.AdamW on the same batches: {apart:.2e}")
    # FSDP2's models hold gloo's work objects; released here, with the interpreter and the process
    # group alive (released at interpreter exit, a gloo thread once aborted the process)
    del model, reference
    gc.collect()
    dist.barrier()  # no rank tears its process group down while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
