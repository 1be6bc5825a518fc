"""fb.Optimizer inside other people's loops: Lightning's Trainer and Hugging Face's Trainer train
a tiny model for a few steps and give the weights of the same loop with the torch.optim class.
Both libraries are optional test dependencies (``pip install -e '.[integrations]'``)."""

from __future__ import annotations

import pytest
import torch
from devices import seeded

import functional_bagua as fb

pytestmark = pytest.mark.cpu_only("Lightning's and Hugging Face's trainers on accelerator='cpu'")

STEPS = 4
TOL = dict(rtol=1e-10, atol=1e-12)  # float64; fb's hyperparameters are float64 tensors, torch's Python floats


def lightning_run(make_optimizer):
    lightning = pytest.importorskip("lightning", reason="Lightning is an optional test dependency: .[integrations]")

    class Regression(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            optimizer = make_optimizer(self.net.parameters())
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    gen = seeded(1)
    data = [
        (torch.randn(8, 4, generator=gen, dtype=torch.float64), torch.randn(8, 1, generator=gen, dtype=torch.float64))
    ]
    module = Regression()
    trainer = lightning.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data * STEPS, batch_size=None))
    return module.net, trainer.optimizers[0]


def assert_trained_with(optimizer):
    """The loop stepped our optimizer STEPS times and its scheduler moved the lr."""
    assert isinstance(optimizer, fb.Optimizer)
    group = optimizer.state_dict()["param_groups"][0]
    assert int(group["shared_state"]["count"]) == STEPS
    assert group["lr"] == pytest.approx(1e-2 * 0.5 ** (STEPS // 2))


def assert_same_weights(expected, actual, **tol):
    for (name, p), q in zip(expected.named_parameters(), actual.parameters()):
        torch.testing.assert_close(q, p, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("fused", [None, False], ids=["kernel", "pure"])
def test_lightning_trains_as_with_the_torch_class(fused):
    """By default (torch's kernel) the weights of torch.optim.AdamW(fused=True), bit for bit;
    the pure update gives those of its default step, within float64 rounding."""
    torch_kind = dict(fused=True) if fused is None else {}
    expected, _ = lightning_run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **torch_kind))
    actual, optimizer = lightning_run(lambda ps: fb.Optimizer(ps, fb.adamw, lr=1e-2, weight_decay=0.1, fused=fused))
    assert_trained_with(optimizer)
    assert_same_weights(expected, actual, **(dict(rtol=0, atol=0) if fused is None else TOL))


def test_lightnings_device_move_moves_the_chains_state():
    """Lightning moves an optimizer's state with _optimizer_to_device (on a resume, to the model's
    device); here to the meta device: every per-parameter tensor of the chain's state goes."""
    pytest.importorskip("lightning", reason="Lightning is an optional test dependency: .[integrations]")
    from lightning.fabric.utilities.optimizer import _optimizer_to_device

    model = torch.nn.Linear(3, 2)
    optimizer = fb.Optimizer(model.parameters(), fb.adamw, lr=1e-2)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()  # the state is made at the first step
    _optimizer_to_device(optimizer, torch.device("meta"))
    per_parameter = optimizer.state_dict()["state"]
    assert len(per_parameter) == 2
    assert {t.device.type for entries in per_parameter.values() for t in entries.values()} == {"meta"}


def hf_run(make_optimizer, tmp_path):
    transformers = pytest.importorskip(
        "transformers", reason="Hugging Face transformers is an optional test dependency: .[integrations]"
    )
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate: .[integrations]")
    config = transformers.BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=2,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).double()
    gen = seeded(1)
    rows = [
        {"input_ids": torch.randint(0, 40, (8,), generator=gen), "labels": torch.randint(0, 2, (), generator=gen)}
        for _ in range(4 * STEPS)
    ]
    optimizer = make_optimizer(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    transformers.Trainer(model=model, args=args, train_dataset=rows, optimizers=(optimizer, scheduler)).train()
    return model, optimizer


def test_hugging_face_trainer_trains_as_with_the_torch_class(tmp_path):
    """torch's kernel by default: the weights of torch.optim.AdamW(fused=True), bit for bit."""
    expected, _ = hf_run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True), tmp_path / "torch")
    actual, optimizer = hf_run(lambda ps: fb.Optimizer(ps, fb.adamw, lr=1e-2, weight_decay=0.1), tmp_path / "fb")
    assert_trained_with(optimizer)
    assert_same_weights(expected, actual, rtol=0, atol=0)


def test_hugging_face_trainer_drives_schedule_free_as_the_schedulefree_package(tmp_path):
    """The Trainer calls optimizer.train() before its steps (the package's optimizer refuses to
    step without it): fb.Optimizer's schedule-free AdamW, in the same loop with a StepLR
    schedule, ends with the package's weights."""
    schedulefree = pytest.importorskip("schedulefree", reason="the schedulefree package is the reference")
    kwargs = dict(lr=1e-2, weight_decay=0.1, warmup_steps=2)
    expected, _ = hf_run(lambda ps: schedulefree.AdamWScheduleFree(ps, **kwargs), tmp_path / "reference")
    actual, optimizer = hf_run(lambda ps: fb.Optimizer(ps, fb.schedule_free_adamw, **kwargs), tmp_path / "fb")
    assert_same_weights(expected, actual, rtol=1e-12, atol=1e-14)
