"""fb.Optimizer in Hugging Face's Trainer: ``Trainer(..., optimizers=(fb.Optimizer(...), scheduler))``
on a tiny BERT classifier built from a config (no download).

    pip install -e '.[integrations]' && python examples/hf_trainer.py [--steps 60]

The task: label a random token sequence 1 when it contains token 7. The script prints the loss
every few steps from its own callback and the accuracy on held-out sequences before and after
training.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

import functional_bagua as fb

VOCAB, LENGTH = 32, 12


def sequences(n: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(8, VOCAB, (LENGTH,), generator=gen)
        label = int(torch.rand((), generator=gen) < 0.5)
        if label:
            ids[torch.randint(0, LENGTH, (), generator=gen)] = 7
        rows.append({"input_ids": ids, "labels": torch.tensor(label)})
    return rows


def accuracy(model: torch.nn.Module, rows: list[dict]) -> float:
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.stack([r["input_ids"] for r in rows])).logits
    model.train()
    return (logits.argmax(-1) == torch.stack([r["labels"] for r in rows])).float().mean().item()


class PrintLoss(transformers.TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
        if logs and "loss" in logs:
            print(f"step {state.global_step:3d}  loss {logs['loss']:.4f}")


def main(steps: int = 60) -> tuple[float, float]:
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=LENGTH,
        num_labels=2,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    held_out = sequences(256, seed=2)
    before = accuracy(model, held_out)
    optimizer = fb.Optimizer(model.parameters(), fb.adamw, lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=steps)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=32,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            logging_steps=max(1, steps // 5),
            disable_tqdm=True,
            seed=0,
        )
        trainer = transformers.Trainer(
            model=model,
            args=args,
            train_dataset=sequences(32 * steps, seed=1),
            optimizers=(optimizer, scheduler),
            callbacks=[PrintLoss()],
        )
        trainer.remove_callback(transformers.PrinterCallback)  # our callback prints instead
        trainer.train()
    after = accuracy(model, held_out)
    print(f"held-out accuracy: {before:.2f} before training, {after:.2f} after {steps} steps of fb.Optimizer(fb.adamw)")
    return before, after


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    main(parser.parse_args().steps)
