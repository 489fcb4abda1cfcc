"""A model sharded by `veragged.fully_shard` is freed once its user drops it, as torch's is.

Its DBuffers hold the mesh's process groups: a model kept alive after a training step (the
gradient-landing hooks on the unsharded parameters once closed a cycle through their C++ side)
kept its memory and, on a mesh of its own, the groups' gloo threads."""

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import veragged
from tests.harness import get_mesh, run_on_ranks

IMPLS = {"torch": torch_fully_shard, "veragged": veragged.fully_shard}


def _dropped_model_is_freed(impl):
    fs = IMPLS[impl]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    fs(model[0], mesh=get_mesh())
    fs(model[2], mesh=get_mesh())
    fs(model, mesh=get_mesh())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    ref = weakref.ref(model)
    del model, opt
    for _ in range(4):
        gc.collect()
    return ref() is None


@pytest.mark.parametrize("mesh_shape", [(2,), (1, 2)], ids=["1d", "hsdp"])
def test_dropped_model_is_freed_like_torchs(mesh_shape):
    names = ("replicate", "shard")[-len(mesh_shape):]
    for impl in ("torch", "veragged"):
        freed = run_on_ranks(_dropped_model_is_freed, 2, args=(impl,), mesh_shape=mesh_shape,
                             mesh_dim_names=names)
        assert freed == [True, True], impl
