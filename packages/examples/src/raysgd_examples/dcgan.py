"""A DCGAN on the 8x8 digits: two models and two optimizers in one custom operator.

    python -m raysgd_examples.dcgan --num-workers 2 --epochs 30 --out-dir /tmp/dcgan

`train_batch` takes a generator step and a discriminator step. Backward and optimizer steps go through
the operator's precision helpers, so the same loop runs in full precision, bf16 or fp16 (`--fp16`)
with the loss scaled for each optimizer. The point is the training loop: a GAN this small on 1.4k
images is fragile and often collapses to a few shapes (look at `--out-dir`'s samples); tune it
before reading anything into its pictures.
"""

from __future__ import annotations

import argparse
import os

import ray
import torch
from torch import nn
from torch.utils.data import DataLoader

from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE
from raysgd_examples.data import digits_datasets

__all__ = ["Discriminator", "GANOperator", "Generator", "main", "save_samples"]


class Generator(nn.Module):
    """Noise of `latent_dim` values -> a 1x8x8 image in [0, 1]."""

    def __init__(self, latent_dim: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(latent_dim, 64 * 2 * 2),
            nn.ReLU(),
            nn.Unflatten(1, (64, 2, 2)),
            nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1),  # 2x2 -> 4x4
            nn.ReLU(),
            nn.ConvTranspose2d(32, 1, 4, stride=2, padding=1),  # 4x4 -> 8x8
            nn.Sigmoid(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


class Discriminator(nn.Module):
    """A 1x8x8 image -> one logit, "real" when positive."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, 3, stride=2, padding=1),  # 8x8 -> 4x4
            nn.LeakyReLU(0.2),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),  # 4x4 -> 2x2
            nn.LeakyReLU(0.2),
            nn.Flatten(),
            nn.Linear(64 * 2 * 2, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class GANOperator(TrainingOperator):
    """Registers both models and both optimizers, and replaces the per-batch step."""

    def setup(self, config: dict) -> None:
        torch.manual_seed(config.get("seed", 0))
        discriminator, generator = Discriminator(), Generator(config["latent_dim"])
        betas = (0.5, 0.999)  # the usual DCGAN setting
        opt_d = torch.optim.Adam(discriminator.parameters(), lr=config["lr"], betas=betas)
        opt_g = torch.optim.Adam(generator.parameters(), lr=config["lr"], betas=betas)
        # Logits + BCEWithLogitsLoss: numerically safe under autocast, unlike Sigmoid + BCELoss.
        self.models, self.optimizers, self.criterion = self.register(
            models=(discriminator, generator),
            optimizers=(opt_d, opt_g),
            criterion=nn.BCEWithLogitsLoss(),
        )
        train_set, _ = digits_datasets(config.get("data_dir"))
        # Only images are needed; drop_last keeps every batch the same size on every worker.
        self.register_data(
            train_loader=DataLoader(
                train_set, batch_size=config[BATCH_SIZE], shuffle=True, drop_last=True
            )
        )

    def train_batch(self, batch: tuple[torch.Tensor, torch.Tensor], batch_info: dict) -> dict:
        discriminator, generator = self.models
        opt_d, opt_g = self.optimizers
        real = batch[0].to(self.device)
        n = real.size(0)
        real_label = torch.ones(n, 1, device=self.device)
        fake_label = torch.zeros(n, 1, device=self.device)
        noise = torch.randn(n, self.config["latent_dim"], device=self.device)

        # Generator: make the discriminator call the fakes real.
        opt_g.zero_grad()
        with self.autocast():
            fake = generator(noise)
            loss_g = self.criterion(discriminator(fake), real_label)
        self.backward(loss_g, opt_g)
        self.optimizer_step(opt_g)

        # Discriminator: real images are 1, fakes are 0 (detached: no generator gradients here).
        # One forward over both halves, so DDP sees the discriminator used once per backward.
        opt_d.zero_grad()
        with self.autocast():
            logits = discriminator(torch.cat([real, fake.detach()]))
            loss_d = self.criterion(logits, torch.cat([real_label, fake_label]))
        self.backward(loss_d, opt_d)
        self.optimizer_step(opt_d)

        with torch.no_grad():
            d_real = torch.sigmoid(logits[:n].float()).mean().item()
        return {
            "loss_g": loss_g.item(),
            "loss_d": loss_d.item(),
            "d_real": d_real,
            "num_samples": n,
        }


def save_samples(generator: nn.Module, latent_dim: int, path: str, count: int = 32) -> None:
    """Draw `count` generated digits into a PNG grid."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    with torch.no_grad():
        images = generator(torch.randn(count, latent_dim)).squeeze(1)
    fig, axes = plt.subplots(4, count // 4, figsize=(count // 4, 4))
    for image, ax in zip(images, axes.flat):
        ax.imshow(image.numpy(), cmap="gray_r", vmin=0, vmax=1)
        ax.axis("off")
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Train the GAN; prints its losses per epoch and, with --out-dir, saves drawn digits."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument(
        "--address",
        default=None,
        help='Ray cluster to join: "auto" (the one `ray start` runs here) or host:port; '
        "default: the trainer starts a private local one",
    )
    parser.add_argument("--fp16", action="store_true", help="mixed precision (bf16 on CPU)")
    parser.add_argument("--out-dir", default=None, help="save generated samples here (PNG)")
    parser.add_argument("--smoke", action="store_true", help="two epochs, for CI")
    args = parser.parse_args(argv)

    latent_dim = 16
    if args.address:
        ray.init(address=args.address)  # else TorchTrainer starts a local Ray of its own
    trainer = TorchTrainer(
        training_operator_cls=GANOperator,
        num_workers=args.num_workers,
        config={"lr": 2e-4, "latent_dim": latent_dim, BATCH_SIZE: 64},  # the DCGAN paper's lr
        use_fp16=args.fp16,
    )
    for _ in range(2 if args.smoke else args.epochs):
        stats = trainer.train()
        print(
            f"epoch {stats['epoch']}: loss_g={stats['loss_g']:.4f} loss_d={stats['loss_d']:.4f} "
            f"D(real)={stats['d_real']:.3f}"
        )
    _, generator = trainer.get_model(to_cpu=True)  # a list: one entry per registered model
    trainer.shutdown()
    ray.shutdown()

    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        path = os.path.join(args.out_dir, "dcgan_samples.png")
        save_samples(generator, latent_dim, path)
        print(f"samples: {path}")


if __name__ == "__main__":
    main()
