"""`potluck.Optimizer` driven by Hugging Face `Trainer` and by Lightning, in one collaboration."""

from __future__ import annotations

import hashlib
import logging
import threading

import pytest
import torch

import potluck
from potluck.cli.tasks import load_data, make_model

X, Y, _, _ = load_data()
BATCH, TARGET, EPOCHS, LR = 32, 128, 4, 3e-3


def digest(model: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


class Classifier(torch.nn.Module):
    """The demo CNN with the calling convention of Hugging Face models (a dict with the loss)."""

    def __init__(self):
        super().__init__()
        self.net = make_model()

    def forward(self, pixels, labels=None):
        logits = self.net(pixels)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def collaborative(peer: potluck.Peer, model: torch.nn.Module) -> potluck.Optimizer:
    return potluck.Optimizer(peer, "frameworks", model.parameters(), lambda p: torch.optim.Adam(p, LR),
                             target_batch_size=TARGET, batch_size_per_step=BATCH, load_state=False)


def train_with_hugging_face(model: Classifier, opt: potluck.Optimizer, out: str) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments
    data = [{"pixels": X[i], "labels": Y[i]} for i in range(len(Y))]
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH, max_steps=10_000,
                             report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0, seed=1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)

    class StopAtEpoch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = opt.local_epoch >= EPOCHS
    Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, scheduler),
            callbacks=[StopAtEpoch()]).train()


def train_with_lightning(model: Classifier, opt: potluck.Optimizer, out: str) -> None:
    import lightning

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, index):
            return self.model(*batch)["loss"]

        def on_train_batch_end(self, outputs, batch, index):
            if opt.local_epoch >= EPOCHS:
                self.trainer.should_stop = True

        def configure_optimizers(self):
            return opt
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=BATCH, shuffle=True,
                                         generator=torch.Generator().manual_seed(2))
    trainer = lightning.Trainer(max_epochs=1000, accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=out)
    trainer.fit(Module(), loader)


@pytest.mark.timeout(240)
def test_hugging_face_trainer_and_lightning_train_together(tmp_path):
    logging.getLogger("lightning").setLevel(logging.WARNING)
    with potluck.Peer(host="127.0.0.1") as first, \
            potluck.Peer(host="127.0.0.1", initial_peers=first.addresses) as second:
        hf_model, pl_model = Classifier(), Classifier()
        hf_opt, pl_opt = collaborative(first, hf_model), collaborative(second, pl_model)
        hf_thread = threading.Thread(target=train_with_hugging_face, args=(hf_model, hf_opt, str(tmp_path / "hf")))
        hf_thread.start()
        train_with_lightning(pl_model, pl_opt, str(tmp_path / "pl"))
        hf_thread.join(120)
        assert not hf_thread.is_alive()
        epochs = [hf_opt.local_epoch, pl_opt.local_epoch]
        hf_opt.shutdown()
        pl_opt.shutdown()
    assert min(epochs) >= EPOCHS
    assert digest(hf_model) == digest(pl_model)  # both took the same averaged steps
    assert digest(hf_model) != digest(Classifier())  # and they did learn something
