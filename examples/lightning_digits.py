"""A LightningModule on scikit-learn's bundled digits, data-parallel with hvdp.lightning.

The Trainer's strategy is hvdp's: each process is one worker started by horovodrun (Lightning
starts none), gradients are averaged with the chosen codec, metrics logged with sync_dist are
averaged over the workers. Run it (two workers on this machine):

    horovodrun -np 2 -H localhost:2 python examples/lightning_digits.py --compression int8
"""
import argparse

import lightning.pytorch as pl
import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

import hvdp.torch as hvd
from hvdp.lightning import HorovodStrategy


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05, help="for one worker; scaled by the number of workers")
    p.add_argument("--compression", default="none", help="none, fp16, bf16, int8, int4, topk, powersgd, auto")
    p.add_argument("--precision", default="32-true", help="Lightning's: 32-true, bf16-mixed, 16-mixed (GPU)")
    p.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=)")
    p.add_argument("--ckpt-dir", help="save a checkpoint per epoch here (rank 0 writes)")
    p.add_argument("--resume", help="a checkpoint to resume from")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def datasets(seed=0):
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    return (TensorDataset(torch.from_numpy(xtr), torch.from_numpy(ytr).long()),
            TensorDataset(torch.from_numpy(xte), torch.from_numpy(yte).long()))


class Digits(pl.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                       torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                       torch.nn.Linear(256, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        acc = (self.net(x).argmax(1) == y).float().mean()
        self.log("val_acc", acc, sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    pl.seed_everything(args.seed, verbose=False)
    train, test = datasets()
    callbacks = []
    if args.ckpt_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True))
    trainer = pl.Trainer(max_epochs=args.epochs, strategy=HorovodStrategy(compression=args.compression),
                         precision=args.precision, accumulate_grad_batches=args.accumulate, logger=False,
                         enable_checkpointing=bool(args.ckpt_dir), callbacks=callbacks,
                         enable_progress_bar=hvd.rank() == 0, enable_model_summary=False)
    model = Digits(args.lr * hvd.size())
    trainer.fit(model, DataLoader(train, batch_size=args.batch_size, shuffle=True),
                DataLoader(test, batch_size=256), ckpt_path=args.resume)
    stats = trainer.strategy.optimizers[0].compression_stats()
    if trainer.is_global_zero:
        print(f"val_acc {trainer.callback_metrics['val_acc'].item():.4f}  |  compression {stats['codec']}: "
              f"wire bytes {stats['total']['all']['ratio']:.3f} of float32", flush=True)
    return trainer.callback_metrics["val_acc"].item()


if __name__ == "__main__":
    main()
