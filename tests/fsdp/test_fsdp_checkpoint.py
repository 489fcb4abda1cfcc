"""State dicts of a fully_shard model and its AdamW (get/set_state_dict, DCP): 4 -> 2 ranks."""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import veragged
from tests.harness import get_mesh, run_on_ranks
from veragged.models.llama import Llama, LlamaConfig

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, hidden=86, max_seq=9)


def _model():
    torch.manual_seed(0)
    model = Llama(CFG)
    for block in model.blocks:
        veragged.fully_shard(block, mesh=get_mesh())
    veragged.fully_shard(model, mesh=get_mesh())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full(tree):
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in tree.items()
        if isinstance(v, torch.Tensor)
    }


def _snapshot(model, opt):
    model_sd, optim_sd = get_state_dict(model, opt)
    return _full(model_sd), {fqn: _full(state) for fqn, state in optim_sd["state"].items()}


def _save(path):
    model, opt = _model()
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        model.loss(torch.randint(0, CFG.vocab, (2, 9), generator=g)).backward()
        opt.step()
        opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return _snapshot(model, opt)


def _load(path):
    model, opt = _model()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    snapshot = _snapshot(model, opt)
    # and training goes on from there
    model.loss(torch.randint(0, CFG.vocab, (2, 9))).backward()
    opt.step()
    return snapshot


def test_save_on_4_load_on_2(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(_save, 4, args=(path,), timeout=180)[0]
    loaded = run_on_ranks(_load, 2, args=(path,), timeout=180)[0]
    (params, states), (params2, states2) = saved, loaded
    assert params.keys() == params2.keys() and states.keys() == states2.keys()
    for k in params:
        assert torch.equal(params[k], params2[k]), k
    for fqn in states:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(states[fqn][key], states2[fqn][key]), (fqn, key)
