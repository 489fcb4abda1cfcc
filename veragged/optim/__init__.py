"""Optimizers on RaggedShard parameters: distributed Muon and block-wise 8-bit AdamW."""

from veragged.optim.muon import Muon
from veragged.optim.owners import OwnerPlan, plan_owners

__all__ = ["Muon", "OwnerPlan", "plan_owners"]
