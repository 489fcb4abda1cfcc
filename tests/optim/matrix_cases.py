"""Shared setups for the matrix optimizer tests: models, param groups, optimizer factories, the
distributed-vs-one-process run, whole values and gradients of sharded parameters, and DCP
save/load of a model with its optimizer (also used by the stress harness)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import veragged
from veragged.optim import SOAP, Muon, Shampoo
from tests.harness import get_mesh
from tests.harness.grads import set_grads
from veragged.models.llama import Llama, LlamaConfig

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, hidden=86, max_seq=9)


def granularity(fqn, p):
    if fqn.endswith("qkv.weight"):
        return 4 * p.shape[1]  # 4-row blocks
    if fqn.endswith("norm.weight") or fqn.endswith("w2.weight"):
        return p.numel()  # whole tensor on one rank: the others hold empty shards
    return None


def model(kind, mesh, cfg=CFG):
    torch.manual_seed(0)
    m = Llama(cfg)
    if kind == "veragged":
        for block in m.blocks:
            veragged.fully_shard(block, mesh=mesh, granularity_fn=granularity)
        veragged.fully_shard(m, mesh=mesh, granularity_fn=granularity)
    elif kind == "torch":
        from torch.distributed.fsdp import fully_shard

        for block in m.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
    return m


def groups(m, flag):
    """Embedding and head elementwise (`flag`: the optimizer's "not a matrix" group key), the
    other parameters by the default rule (2-D: matrix, 1-D: elementwise)."""
    named = dict(m.named_parameters())
    emb = [p for n, p in named.items() if "embed" in n or "head" in n]
    rest = [p for n, p in named.items() if not any(p is q for q in emb)]
    return [{"params": emb, flag: False}, {"params": rest}]


def shampoo(m, **kw):
    # max_preconditioner_dim 24 blocks the 32- and 86-wide matrices (tiles with a remainder);
    # preconditioning starts at step 3 so the grafting-only steps run too
    kw = dict(dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.01, max_preconditioner_dim=24,
                   precondition_frequency=2, start_preconditioning_step=3), **kw)
    return Shampoo(groups(m, "precondition"), **kw)


def soap(m, **kw):
    # max_precond_dim 40: the 86-wide w1/w3 (86 x 32) and w2 (32 x 86) keep one side only
    kw = dict(dict(lr=0.01, weight_decay=0.01, precondition_frequency=3, max_precond_dim=40),
              **kw)
    return SOAP(groups(m, "precondition"), **kw)


def muon(m, **kw):
    return Muon(groups(m, "use_muon"), **dict(dict(lr=0.02, weight_decay=0.1), **kw))


FACTORIES = {"shampoo": shampoo, "soap": soap, "muon": muon}


def present(pattern):
    """Grad presence per (step, param, rank): all, or a rank-asymmetric cycle."""

    def at(step):
        def has(i, r):
            if pattern == "all":
                return True
            return (step + i + r) % 3 != 0 and not (step % 5 == 4 and i % 2)

        return has

    return at


def full_values(params):
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in params]


def grads_to(ref_params, params):
    """The gradients a sharded run made, whole, as the reference parameters' gradients."""
    for p, q in zip(params, ref_params):
        q.grad = None if p.grad is None else (
            p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone())


def save_checkpoint(m, opt, path):
    """DCP save of the model and optimizer state dicts (torch's `get_state_dict`)."""
    model_sd, optim_sd = get_state_dict(m, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def load_checkpoint(m, opt, path):
    """DCP load into the model and optimizer (torch's `set_state_dict`)."""
    model_sd, optim_sd = get_state_dict(m, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def step_with_reference(opt, ref, params, ref_params, steps, pattern):
    """`steps` steps of `opt` on sharded `params` and of `ref` on full `ref_params` fed the
    gradients a single process would see (grad presence by `present(pattern)`)."""
    at = present(pattern)
    for step in range(steps):
        for p, g in zip(ref_params, set_grads(params, step, at(step))):
            p.grad = g
        opt.step()
        ref.step()


def distributed_vs_one_process(name, kind, steps, owners, pattern):
    """`name` on sharded parameters and, in the same process, on full ones with the gradients a
    single process would see; returns the largest difference per parameter and the plans."""
    make = FACTORIES[name]
    m = model(kind, get_mesh())
    opt = make(m, owners=owners, grad_agreement="mesh")  # gradients dropped by hand
    ref_model = model("single", None)
    ref = make(ref_model)
    params, ref_params = list(m.parameters()), list(ref_model.parameters())
    step_with_reference(opt, ref, params, ref_params, steps, pattern)
    diffs = [(a - b).abs().max().item() for a, b in zip(full_values(params), ref_params)]
    plans = [(pl.owners, pl.groups, pl.ratio) for pl in opt.owner_plans]
    return diffs, plans
