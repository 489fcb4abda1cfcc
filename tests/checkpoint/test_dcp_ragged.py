"""torch.distributed.checkpoint save/load of RaggedShard DTensors, unchanged DCP, across layouts.

The matrix: save on 4 ranks -> load on 4 (other local_units, Shard(0), root-only), on 2, then
save on 2 -> load on 3, load into plain tensors without a process group, and a checkpoint of
torch Shard(0) DTensors loaded into RaggedShard ones.
"""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _gather_state_dict
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode

import veragged
from veragged import RaggedShard
from tests.harness import get_mesh, run_on_ranks

SHAPES = {"a": (7, 13), "b": (3, 4, 5), "c": (18, 5), "root": (5, 3), "d": (18, 5)}


def _full(name):
    g = torch.Generator().manual_seed(sorted(SHAPES).index(name))
    return torch.randn(SHAPES[name], generator=g)


def _dtensor(name, placement):
    mesh = get_mesh()
    if isinstance(placement, RaggedShard):
        return veragged.distribute_tensor(_full(name), mesh, [placement])
    return torch.distributed.tensor.distribute_tensor(_full(name), mesh, [placement])


def _empty_like_layout(dt):
    """A DTensor of the same layout as `dt` whose data is garbage, to load into."""
    with torch.no_grad():
        return torch.zeros_like(dt).fill_(float("nan"))


def _check_loaded(state):
    return {k: torch.equal(v.full_tensor(), _full(k)) for k, v in state.items()}


def _save_on_4(path):
    saved = {
        "a": _dtensor("a", RaggedShard((0, 1), (30, 0, 51, 10))),
        "b": _dtensor("b", RaggedShard((0, 1), (2, 5, 1, 4))),
        "c": _dtensor("c", Shard(0)),
        "root": _dtensor("root", RaggedShard((), (0, 0, 1, 0))),
        "d": _dtensor("d", RaggedShard((0,), (5, 0, 9, 4))),
    }
    with CommDebugMode() as comm:
        boxes = {k: len(v.__create_write_items__(k, v)) for k, v in saved.items() if k != "c"}
        for k, v in saved.items():
            for chunk in v.__create_chunk_list__():
                v.__get_tensor_shard__(
                    torch.distributed.checkpoint.metadata.MetadataIndex(k, chunk.offsets)
                )
    dcp.save(saved, checkpoint_id=path)
    # torch's full-state-dict gather (get_state_dict(full_state_dict=True)) calls redistribute.
    gathered = _gather_state_dict(saved)
    full_ok = all(torch.equal(gathered[k], _full(k)) for k in saved)
    loaded = {
        "a": _empty_like_layout(_dtensor("a", RaggedShard((0,), (0, 3, 3, 1)))),
        "b": _empty_like_layout(_dtensor("b", Shard(0))),
        "c": _empty_like_layout(_dtensor("c", RaggedShard((0,), (1, 1, 1, 15)))),
        "root": _empty_like_layout(_dtensor("root", RaggedShard((0, 1), (4, 4, 4, 3)))),
        "d": _empty_like_layout(_dtensor("d", RaggedShard((), (0, 1, 0, 0)))),
    }
    dcp.load(loaded, checkpoint_id=path)
    checks = {"full_state_dict": full_ok, **_check_loaded(loaded)}
    return {"boxes": boxes, "comms": comm.get_total_counts(), "loaded": checks}


def _load_on_2_then_save(src, dst):
    state = {
        "a": _empty_like_layout(_dtensor("a", RaggedShard((0, 1), (1, 90)))),
        "b": _empty_like_layout(_dtensor("b", RaggedShard((0,), (1, 2)))),
        "c": _empty_like_layout(_dtensor("c", RaggedShard((0,), (1, 0)))),
        "root": _empty_like_layout(_dtensor("root", RaggedShard((0,), (2, 3)))),
        "d": _empty_like_layout(_dtensor("d", RaggedShard((0,), (1, 1)))),
    }
    dcp.load(state, checkpoint_id=src)
    ok = _check_loaded(state)
    dcp.save(state, checkpoint_id=dst)
    return ok


def _load_on_3(path):
    state = {
        "a": _empty_like_layout(_dtensor("a", RaggedShard((0, 1), (40, 1, 50)))),
        "b": _empty_like_layout(_dtensor("b", RaggedShard((0, 1), (0, 0, 1)))),
        "c": _empty_like_layout(_dtensor("c", Shard(0))),
        "root": _empty_like_layout(_dtensor("root", RaggedShard((0,), (1, 3, 1)))),
        "d": _empty_like_layout(_dtensor("d", RaggedShard((0,), (1, 1, 1)))),
    }
    dcp.load(state, checkpoint_id=path)
    return _check_loaded(state)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_matrix(tmp_path):
    ckpt4, ckpt2 = str(tmp_path / "four"), str(tmp_path / "two")
    for res in run_on_ranks(_save_on_4, 4, args=(ckpt4,), timeout=180):
        assert res["comms"] == 0  # describing and reading boxes needs no communication
        assert res["boxes"]["a"] <= 3 and res["boxes"]["b"] <= 3 and res["boxes"]["d"] <= 1, res
        assert all(res["loaded"].values()), res
    for ok in run_on_ranks(_load_on_2_then_save, 2, args=(ckpt4, ckpt2), timeout=180):
        assert all(ok.values()), ok
    for ok in run_on_ranks(_load_on_3, 3, args=(ckpt2,), timeout=180):
        assert all(ok.values()), ok
    # Plain tensors, no process group: DCP reads every saved box.
    plain = {k: torch.full(shape, float("nan")) for k, shape in SHAPES.items()}
    dcp.load(plain, checkpoint_id=ckpt4, no_dist=True)
    for k, v in plain.items():
        assert torch.equal(v, _full(k)), k


def _boxes_tile_the_tensor():
    """Each rank's boxes, with their local data, for a 3-D element-granular layout."""
    dt = _dtensor("b", RaggedShard((0, 1, 2), (17, 13, 0, 30)))
    out = []
    for chunk in dt.__create_chunk_list__():
        view = dt.__get_tensor_shard__(
            torch.distributed.checkpoint.metadata.MetadataIndex("b", chunk.offsets)
        )
        out.append((tuple(chunk.offsets), tuple(chunk.sizes), view.clone()))
    return dist.get_rank(), out


def test_boxes_of_all_ranks_tile_the_tensor_once():
    full = _full("b")
    seen = torch.zeros(SHAPES["b"], dtype=torch.int64)
    for rank, boxes in run_on_ranks(_boxes_tile_the_tensor, 4, timeout=120):
        assert len(boxes) <= 2 * 3 - 1
        for offsets, sizes, data in boxes:
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            assert torch.equal(full[index], data)
            seen[index] += 1
    assert bool((seen == 1).all())


def _from_shard0_checkpoint(path, save):
    if save:
        dcp.save({"c": _dtensor("c", Shard(0)), "a": _dtensor("a", Shard(0))}, checkpoint_id=path)
        return True
    state = {
        "c": _empty_like_layout(_dtensor("c", RaggedShard((0,), (3, 0, 2, 1)))),
        "a": _empty_like_layout(_dtensor("a", RaggedShard((0, 1), (0, 91, 0, 0)))),
    }
    dcp.load(state, checkpoint_id=path)
    return all(_check_loaded(state).values()) and all(
        isinstance(v, DTensor) for v in state.values()
    )


def test_torch_shard0_checkpoint_loads_into_ragged(tmp_path):
    path = str(tmp_path / "s0")
    run_on_ranks(_from_shard0_checkpoint, 4, args=(path, True), timeout=120)
    assert all(run_on_ranks(_from_shard0_checkpoint, 4, args=(path, False), timeout=120))
