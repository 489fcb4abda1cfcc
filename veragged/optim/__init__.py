"""Optimizers on RaggedShard parameters: distributed Muon, Shampoo and SOAP on one owner engine,
and block-wise 8-bit AdamW."""

from veragged.optim.adamw8bit import AdamW8bit, adamw8bit_granularity
from veragged.optim.common import declare_symmetric_grads
from veragged.optim.muon import Muon
from veragged.optim.owners import OwnerPlan, plan_owners
from veragged.optim.shampoo import Shampoo
from veragged.optim.soap import SOAP

__all__ = [
    "AdamW8bit",
    "Muon",
    "OwnerPlan",
    "SOAP",
    "Shampoo",
    "adamw8bit_granularity",
    "declare_symmetric_grads",
    "plan_owners",
]
