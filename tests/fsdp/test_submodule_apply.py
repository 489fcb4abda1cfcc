"""`to_empty()`, `.to()` and casts on a plain submodule of a sharded module (torchtune's LoRA
init), as torch's fully_shard allows: [Note: submodule _apply]."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.fsdp.test_lifecycle import IMPLS
from tests.harness.device import rank_device_type
from tests.harness.pool import get_pool


class LoRALinear(nn.Module):
    def __init__(self, d: int, r: int):
        super().__init__()
        self.base = nn.Linear(d, d)
        self.lora_a = nn.Linear(d, r, bias=False)
        self.lora_b = nn.Linear(r, d, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = LoRALinear(12, 3)
        self.out = nn.Linear(12, 5)

    def forward(self, x):
        return self.out(torch.relu(self.attn(x)))


def _run(impl: str, steps: int = 3):
    mesh = init_device_mesh(rank_device_type(), (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Block()
    IMPLS[impl](model.attn, mesh=mesh)
    IMPLS[impl](model, mesh=mesh)
    # torchtune's LoRA init: materialise the adapters and initialise them after sharding.
    for sub in (model.attn.lora_a, model.attn.lora_b):
        sub.to_empty(device="cpu")
        torch.manual_seed(7)
        with torch.no_grad():
            for p in sub.parameters():
                full = torch.randn(p.shape)
                p.to_local().copy_(_local_part(p, full))
    model.out.float()  # a cast to the dtype it has: nothing changes
    model.attn.base.to("cpu")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        loss = model(torch.randn(4, 12, generator=g)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    wrong = None
    if impl == "veragged":  # another dtype than its group's, before the first forward
        other = Block()
        IMPLS[impl](other, mesh=mesh)
        other.out.to(torch.float64)
        try:
            other(torch.randn(4, 12))
        except Exception as e:  # noqa: BLE001
            wrong = (type(e).__name__, str(e))
    return torch.stack(losses), {n: p.full_tensor() for n, p in model.named_parameters()}, wrong


def _local_part(p: DTensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` in `p`'s placement (via a DTensor round trip)."""
    from veragged import distribute_tensor
    if type(p).__name__ == "RaggedDTensor":
        return distribute_tensor(full, p.device_mesh, p.placements).to_local()
    from torch.distributed.tensor import distribute_tensor as torch_distribute
    return torch_distribute(full, p.device_mesh, p.placements).to_local()


def test_to_empty_on_a_submodule_matches_torch():
    ref = get_pool(2).run(_run, "torch")
    res = get_pool(2).run(_run, "veragged")
    for (rl, rp, _), (l, p, wrong) in zip(ref, res):
        assert torch.equal(rl, l), (rl, l)
        for n in rp:
            assert torch.equal(rp[n], p[n]), n
        assert wrong is not None and wrong[0] == "NotImplementedError" and "'out.weight'" in wrong[1]
