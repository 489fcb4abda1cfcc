"""Shampoo and SOAP train the example model faster than a tuned AdamW on the seeded Markov-chain
task of test_muon_curve (one process, 60 steps)."""

import torch

import veragged

from test_muon_curve import _final_loss


def test_shampoo_and_soap_below_tuned_adamw():
    """Measured (2 threads): Shampoo (lr 3e-3, roots every step) 0.789, SOAP (lr 5e-3, bases
    refreshed every 2 steps) 0.781; AdamW at 3e-3 / 5e-3 / 1e-2: 0.805 / 0.804 / 0.800 (2e-3:
    0.846, 7e-3: 0.802). The loss floor is ln 2 = 0.693."""
    shampoo = _final_loss(
        lambda m: veragged.optim.Shampoo(m.parameters(), lr=3e-3, precondition_frequency=1))
    soap = _final_loss(lambda m: veragged.optim.SOAP(m.parameters(), lr=5e-3, weight_decay=0.0,
                                                     precondition_frequency=2))
    adamw = min(
        _final_loss(lambda m, lr=lr: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0))
        for lr in (3e-3, 5e-3, 1e-2)
    )
    assert shampoo < adamw - 0.005, (shampoo, adamw)
    assert soap < adamw - 0.005, (soap, adamw)
