"""Muon trains the example model faster than a tuned AdamW on a seeded task (one process)."""

import torch

import veragged
from veragged.models.llama import Llama, LlamaConfig, muon_param_groups

CFG = LlamaConfig(vocab=64, dim=64, layers=2, heads=4, hidden=172, max_seq=33)
STEPS, BATCH, SEQ = 60, 16, 33


def _batches():
    """A Markov chain where each token has two equally likely successors: the loss floor is
    ln 2 = 0.693, and a model has to learn the 64 x 2 successor table to approach it."""
    g = torch.Generator().manual_seed(0)
    successors = torch.randint(0, CFG.vocab, (CFG.vocab, 2), generator=g)
    x = torch.empty(STEPS, BATCH, SEQ, dtype=torch.long)
    x[:, :, 0] = torch.randint(0, CFG.vocab, (STEPS, BATCH), generator=g)
    for t in range(1, SEQ):
        pick = torch.randint(0, 2, (STEPS, BATCH), generator=g)
        x[:, :, t] = successors[x[:, :, t - 1], pick]
    return x


def _final_loss(make_optimizer):
    torch.manual_seed(0)
    model = Llama(CFG)
    opt = make_optimizer(model)
    losses = []
    for batch in _batches():
        loss = model.loss(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return sum(losses[-5:]) / 5


def _muon(model):
    return veragged.optim.Muon(muon_param_groups(model, 3e-3), lr=0.02, weight_decay=0.0)


def test_muon_below_tuned_adamw():
    """Muon at its usual lr (0.02, embeddings/head on AdamW 3e-3) ends below AdamW at the best
    of 3e-3 and 1e-2 (measured: Muon 0.772, AdamW 0.805 and 0.800; AdamW 1e-3: 1.107)."""
    muon = _final_loss(_muon)
    adamw = min(
        _final_loss(lambda m, lr=lr: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0))
        for lr in (3e-3, 1e-2)
    )
    assert muon < adamw - 0.01, (muon, adamw)
    assert muon < 0.8  # and it is learning the table (the floor is 0.693)
