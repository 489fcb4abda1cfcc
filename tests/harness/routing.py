"""A model whose routing depends on the rank, for tests of data-dependent routing under FSDP.

`Routed` has a scale vector, an input layer, `EXPERTS` experts (one module each, as an MoE with
`fused_experts=False`) and an output layer. Each rank runs the experts `routes(step, world)[rank]`
picks for it, so on a step some experts are reached by some ranks only, by none (the last expert
never, others on some steps), and a rank may run none at all. Sharded by `shard`,
every expert tensor lies on one rank, so ranks hold no element of most experts, reached by them
or not, while the input layer's weight (after the scale) crosses several ranks' slots, landing
in pieces ([Note: gradient landing]).
`train` runs steps (forward, backward, clipping, an optimizer) under `fully_shard` or in one
process, which takes the mean of every rank's loss (`one_process_loss`): the gradients
`fully_shard` (averaging over the ranks) must reproduce, with None exactly where no rank reached
a parameter ([Note: unreached parameters]).
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["DIM", "EXPERTS", "Routed", "batch", "dcp_roundtrip", "make_optimizer", "routes",
           "shard", "train"]

DIM, HIDDEN, EXPERTS = 32, 24, 6


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(h)))


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, h: torch.Tensor, route: list[int]) -> torch.Tensor:
        y = h
        for e in route:  # experts not in the route take no part: no gradient from this rank
            y = y + self.experts[e](h)
        return y


class Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(DIM))
        self.inp = nn.Linear(DIM, DIM)
        self.moe = MoE()
        self.out = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor, route: list[int]) -> torch.Tensor:
        """The mean squared error against targets drawn with `x` (its last 4 columns,
        independent of the rest: the loss stays away from 0, so do the gradients, and Muon's
        orthogonalisation stays well conditioned over long runs)."""
        x, target = x[:, :DIM], x[:, DIM:]
        h = torch.tanh(self.inp(x * self.scale))
        return (self.out(self.moe(h, route)).float() - target).pow(2).mean()


def routes(step: int, world: int) -> list[list[int]]:
    """Per rank, the experts it runs at `step`: each of the first `EXPERTS - 1` with
    probability 0.4 (seeded by step and rank), the last never; rank `step % world` runs none."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(7919 * step + r)
        pick = torch.rand(EXPERTS - 1, generator=g) < 0.4
        out.append([] if r == step % world else [e for e in range(EXPERTS - 1) if pick[e]])
    return out


def batch(step: int, rank: int, micro: int = 0) -> torch.Tensor:
    """Rank `rank`'s inputs at `step` (micro-batch `micro`), their targets in 4 more columns."""
    g = torch.Generator().manual_seed(100003 * step + 101 * rank + micro)
    return torch.randn(3, DIM + 4, generator=g)


def one_process_loss(model: Routed, step: int, world: int, micro: int = 0,
                     route_step: int | None = None) -> torch.Tensor:
    """The loss whose gradient is the ranks' averaged one: the mean of every rank's loss."""
    rs = routes(step if route_step is None else route_step, world)
    return sum(model(batch(step, r, micro), rs[r]) for r in range(world)) / world


def shard(model: Routed, mesh, impl: str = "veragged", unused: bool = False,
          granularity_fn=None) -> Routed:
    """`fully_shard` the experts (veragged: each tensor whole on one rank), then the model
    (the scale, input and output layers, with `granularity_fn`); `unused`: torch's
    `set_reduce_scatter_unused_params(True)` (what torch's fully_shard needs to run at all when
    ranks reach different parameters)."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.moe, mesh=mesh)
    else:
        import veragged

        fully_shard = veragged.fully_shard
        fully_shard(model.moe, mesh=mesh, granularity_fn=lambda fqn, p: p.numel())
    fully_shard(model, mesh=mesh, **({} if granularity_fn is None else
                                      {"granularity_fn": granularity_fn}))
    if unused:
        model.set_reduce_scatter_unused_params(True)
    return model


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    """torch's AdamW ("adamw"), or veragged's Muon (matrices; vectors on its AdamW), AdamW8bit
    (8-bit state for tensors of >= 512 elements, blocks of 256), Shampoo or SOAP."""
    import veragged

    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if name == "muon":
        return veragged.optim.Muon(model.parameters(), lr=0.02, weight_decay=0.1)
    if name == "adamw8bit":
        return veragged.optim.AdamW8bit(model.parameters(), lr=1e-2, weight_decay=0.1,
                                        min_8bit_size=512)
    if name == "shampoo":  # roots every 2 steps
        return veragged.optim.Shampoo(model.parameters(), lr=1e-3, weight_decay=0.01,
                                      betas=(0.9, 0.999), precondition_frequency=2)
    if name == "soap":  # bases refreshed every 3 steps
        return veragged.optim.SOAP(model.parameters(), lr=1e-3, precondition_frequency=3)
    raise ValueError(f"make_optimizer: unknown optimizer {name!r}")


def granularity(optim: str):
    """The root group's granularity_fn for `optim` (AdamW8bit: its blocks stay whole)."""
    if optim == "adamw8bit":
        import veragged

        return veragged.optim.adamw8bit_granularity(256, 512)
    return None


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def train(steps: int, world: int, *, mesh=None, impl: str = "veragged", unused: bool = False,
          optim: str = "adamw", clip: str = "torch", scaler: bool = False, micro: int = 1,
          record_grads: bool = True, sample: int = 1, on_sample=None, on_shard=None,
          loss_factor: float = 1.0) -> dict:
    """Train `Routed` for `steps` steps on `world` ranks' data: under `fully_shard` on `mesh`
    (this rank's data and route), or in one process (`mesh=None`: the mean of every rank's
    loss). Each step: `micro` micro-batches (gradient sync on the last one only, each its own
    route), backward (through `GradScaler` if `scaler`), unscale, clip with torch's
    `clip_grad_norm_` ("torch") or `veragged.clip_grad_norm_` ("veragged"; "alternate": torch's
    on even steps) to 0.3 (it bites), step, zero_grad.

    Returns per step the losses (per rank: the one of this rank, or every rank's), which
    parameters have a gradient after backward, the gradients (full tensors, if
    `record_grads`) and the total norm; and the final parameters and the names of the
    parameters with optimizer state. `on_shard(model)` runs once the model is sharded; every
    `sample` steps (and after the last), `on_sample(step, model, opt)` runs if given. Under
    fully_shard the ranks' has-gradient verdicts are compared before anything reads a gradient:
    a disagreement raises instead of pairing mismatched collectives. `loss_factor` multiplies
    every loss: 1 + 2**-22 perturbs a run by about one rounding, which shows how far round-off
    alone moves its trajectory."""
    import torch.distributed as dist

    import veragged

    torch.manual_seed(0)
    model = Routed()
    names = [n for n, _ in model.named_parameters()]
    rank = dist.get_rank() if mesh is not None else None
    if mesh is not None:
        shard(model, mesh, impl, unused, granularity(optim) if impl == "veragged" else None)
        if on_shard is not None:
            on_shard(model)
    params = list(model.parameters())
    opt = make_optimizer(optim, model)
    amp = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1000) if scaler else None
    out = {"losses": [], "present": [], "grads": [], "norms": []}
    for step in range(steps):
        for mb in range(micro):
            rs = routes(step * micro + mb, world)
            if mesh is not None:
                if micro > 1:
                    model.set_requires_gradient_sync(mb == micro - 1)
                loss = model(batch(step, rank, mb), rs[rank]) / micro * loss_factor
                out["losses"].append(loss.item())
            else:
                losses = [model(batch(step, r, mb), rs[r]) / micro for r in range(world)]
                out["losses"].append([x.item() for x in losses])
                loss = sum(losses) / world * loss_factor
            (amp.scale(loss) if amp is not None else loss).backward()
        present = tuple(p.grad is not None for p in params)
        if mesh is not None:
            seen = [None] * dist.get_world_size()
            dist.all_gather_object(seen, present)
            if any(s != present for s in seen):
                raise AssertionError(f"step {step}: ranks disagree on which parameters have a "
                                     f"gradient: {[dict(zip(names, s)) for s in seen]}")
        out["present"].append(present)
        if amp is not None:
            amp.unscale_(opt)
        if record_grads:
            out["grads"].append([None if p.grad is None else _full(p.grad) for p in params])
        torch_clip = clip == "torch" or (clip == "alternate" and step % 2 == 0)
        clip_fn = torch.nn.utils.clip_grad_norm_ if torch_clip else veragged.clip_grad_norm_
        norm = clip_fn(params, 0.3)
        out["norms"].append(_full(norm).item())
        if amp is not None:
            amp.step(opt)
            amp.update()
        else:
            opt.step()
        opt.zero_grad()
        if on_sample is not None and ((step + 1) % sample == 0 or step + 1 == steps):
            on_sample(step, model, opt)
    out["params"] = [_full(p) for p in params]
    out["state"] = sorted(n for n, p in zip(names, params) if opt.state.get(p))
    out["names"] = names
    return out


def dcp_roundtrip(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> dict:
    """Save the model and optimizer state dicts (`get_state_dict`) with DCP, load them into
    zeroed copies and compare this rank's parts. Returns whether every rank has the same
    optimizer-state keys (`keys_agree`), whether the load gave back every tensor bitwise
    (`loaded`), and this rank's keys."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_flatten, tree_map_only

    model_sd, optim_sd = get_state_dict(model, opt)
    keys = sorted(optim_sd["state"])
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, keys)
    saved = {"model": model_sd, "optim": optim_sd}
    dcp.save(saved, checkpoint_id=path)
    target = tree_map_only(torch.Tensor, torch.zeros_like, saved)
    dcp.load(target, checkpoint_id=path)

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    pairs = [(a, b) for a, b in zip(tree_flatten(saved)[0], tree_flatten(target)[0])
             if isinstance(a, torch.Tensor)]
    loaded = bool(pairs) and all(torch.equal(local(a), local(b)) for a, b in pairs)
    return {"keys_agree": all(k == keys for k in every), "loaded": loaded, "keys": keys}
