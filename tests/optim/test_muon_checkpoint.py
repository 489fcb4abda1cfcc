"""Muon state: state_dict round trip, and DCP save on 4 ranks / load on 2, resuming bitwise."""

import copy

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import veragged
from veragged.optim import Muon
from tests.harness import get_mesh, run_on_ranks
from tests.harness.grads import set_grads
from veragged.models.llama import Llama, LlamaConfig, muon_param_groups

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, hidden=86, max_seq=9)


def _setup():
    torch.manual_seed(0)
    model = Llama(CFG)
    for block in model.blocks:
        veragged.fully_shard(block, mesh=get_mesh())
    veragged.fully_shard(model, mesh=get_mesh())
    opt = Muon(muon_param_groups(model), lr=0.02, grad_agreement="mesh")  # grads set by hand
    return model, opt


def _step(model, opt, step):
    set_grads(list(model.parameters()), step, lambda i, r: (i + step) % 4 != 0)  # world-free
    opt.step()


def _full_params(model):
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def _save(path):
    model, opt = _setup()
    for step in range(3):
        _step(model, opt, step)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    _step(model, opt, 3)
    return _full_params(model)


def _load(path):
    model, opt = _setup()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _step(model, opt, 3)
    return _full_params(model)


def test_dcp_save_on_4_load_on_2_resumes_bitwise(tmp_path):
    path = str(tmp_path / "ckpt")
    uninterrupted = run_on_ranks(_save, 4, args=(path,), timeout=180)[0]
    resumed = run_on_ranks(_load, 2, args=(path,), timeout=180)[0]
    assert uninterrupted.keys() == resumed.keys()
    for k in uninterrupted:
        assert torch.equal(uninterrupted[k], resumed[k]), k


def _plain_round_trip():
    model, opt = _setup()
    for step in range(2):
        _step(model, opt, step)
    sd = copy.deepcopy(opt.state_dict())  # state_dict() returns the live tensors
    model2, opt2 = _setup()
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(sd)
    _step(model, opt, 2)
    _step(model2, opt2, 2)
    a, b = _full_params(model), _full_params(model2)
    return all(torch.equal(a[k], b[k]) for k in a) and len(sd["state"]) == len(a)


def test_state_dict_round_trip():
    assert all(run_on_ranks(_plain_round_trip, 2, timeout=120))
