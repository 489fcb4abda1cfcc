"""Optimizers on RaggedShard parameters: distributed Muon and block-wise 8-bit AdamW."""
