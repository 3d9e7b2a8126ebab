"""A small real training loop that checkpoints through ckptstore (run as a child process).

    python trainer.py URL RUN --steps 40 [--resume] [--save-every 5] --losses out.json

Trains a two-layer transformer with dropout, AdamW and a cosine LR schedule on synthetic
data drawn from torch's, numpy's and Python's global RNGs, so resuming is only bit-exact if
model, optimizer, scheduler and all three RNG states come back exactly.
"""

from __future__ import annotations

import argparse
import json
import random

import numpy as np
import torch
from torch import nn

from ckptstore import CheckpointClient

VOCAB, DIM, SEQ, BATCH = 64, 32, 16, 8


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 4, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, VOCAB, (BATCH, SEQ))
    shift = int(np.random.randint(1, 4)) + random.randint(0, 1)
    return x, (x + shift) % VOCAB


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("run")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--losses", required=True)
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40)
    client = CheckpointClient(args.url)
    start = 0
    if args.resume:
        state = client.load(args.run, "latest")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        start = state["step"]
    losses = {}
    model.train()
    for step in range(start + 1, args.steps + 1):
        x, y = batch()
        loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses[step] = loss.item().hex()
        if args.save_every and step % args.save_every == 0:
            client.save(
                args.run,
                step,
                {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(),
                    "rng": {
                        "torch": torch.get_rng_state(),
                        "numpy": np.random.get_state(),
                        "python": random.getstate(),
                    },
                    "step": step,
                },
            )
    with open(args.losses, "w") as f:
        json.dump(losses, f)


if __name__ == "__main__":
    main()
