"""Shared by the FSDP tests: the optimizers the TP/EP tests train with and the one-process run
they compare against; a small block whose weight crosses a DBuffer's rank boundary."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.Linear(16, 48)  # its weight crosses the rank boundary of its DBuffer
        self.small = nn.Linear(48, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(x + self.small(torch.relu(self.big(x))))


def full(p: torch.Tensor) -> torch.Tensor:
    """The full value of a (sharded) parameter or gradient."""
    return p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()


def optimizer(model, opt: str):
    """AdamW exercises the ops on sharded DTensors; SGD keeps one-process round-off small (Adam
    turns a near-zero gradient's round-off into a full lr-sized step of either sign)."""
    if opt == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def one_process(make_model, batches, steps: int):
    """Train `make_model()` (seed 0) with SGD in this process, each step on the mean loss over
    `batches(step)` (one batch per data-parallel rank). Returns the losses and the parameters."""
    torch.manual_seed(0)
    model = make_model()
    optim = optimizer(model, "sgd")
    losses = []
    for step in range(steps):
        loss = torch.stack([model.loss(t) for t in batches(step)]).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
