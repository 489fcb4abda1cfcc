"""A QuantDBuffer's all-gather on 1-8 gloo ranks: the gathered bytes are bit-identical to the
one-process reference quantiser of the full weights (uneven shares, ranks with no tile, partial
tiles, mixed shapes and formats in one group), the unsharded parameters are the reference's
fake-quantised weights, and each unshard is one all-gather with no other collective
([Note: block-scaled weights])."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import veragged
import veragged.dbuffer.quantized as quantized
from veragged.quant.reference import fake_quantize
from veragged.tools.write_counter import WriteCounter
from tests.harness import get_mesh, run_on_ranks
from tests.quant.quant_cases import Mixed, expected_packed, mixed_quant_fn


def _gather_case(name, param_dtype):
    torch.manual_seed(0)
    model = Mixed()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    quant_fn = mixed_quant_fn(name)
    formats = {n: quant_fn(n, p) for n, p in model.named_parameters()}
    veragged.fully_shard(model, mesh=get_mesh(), quant_fn=quant_fn,
                         mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
    buffer = model._get_fsdp_state().groups[0].buffer
    assert isinstance(buffer, quantized.QuantDBuffer)
    captured = []
    real = quantized.dequantize_tiles_

    def capture(dst, packed, table, tiles):
        captured.append(packed.clone())
        real(dst, packed, table, tiles)

    quantized.dequantize_tiles_ = capture
    try:
        counter = WriteCounter(attribute=None)
        with counter:
            model.unshard()
        first = {n: p.detach().clone() for n, p in model.named_parameters()}
        model.reshard()
        with counter:  # gathered again and, a public unshard() outside forward, quantised
            model.unshard()  # again ([Note: shard epochs]; backward's reuse: test_training)
        model.reshard()
    finally:
        quantized.dequantize_tiles_ = real
    expected = expected_packed(buffer, full, param_dtype)
    same_bytes = [torch.equal(c, expected) for c in captured]
    unsharded = all(
        torch.equal(first[n], fake_quantize(full[n].to(param_dtype), f) if f is not None
                    else full[n].to(param_dtype))
        for n, f in formats.items())
    stats = model.quant_stats()[0]
    return dict(same_bytes=same_bytes, unsharded=unsharded, collectives=dict(counter.collectives),
                quantizations=stats.quantizations, all_gathers=stats.all_gathers,
                rank_bytes=stats.rank_bytes, slot_bytes=stats.slot_bytes, world=buffer.world)


@pytest.mark.parametrize("world,name,dtype", [
    (1, "mixed", torch.float32),
    (2, "mixed", torch.bfloat16),
    (3, "mixed", torch.float32),
    (3, "block128", torch.bfloat16),
    (4, "mx_floor", torch.float32),
    (4, "row128", torch.float16),
    (4, "ue8m0", torch.float32),
    (8, "mixed", torch.bfloat16),
])
def test_gathered_bytes_equal_the_one_process_quantiser(world, name, dtype):
    results = run_on_ranks(_gather_case, world, args=(name, dtype), timeout=180)
    for r in results:
        assert r["same_bytes"] == [True, True], r
        assert r["unsharded"], r
        assert r["quantizations"] == 2, r  # one per public unshard(): [Note: shard epochs]
        gathers = {k: v for k, v in r["collectives"].items() if "gather" in k}
        others = {k: v for k, v in r["collectives"].items() if "gather" not in k}
        assert others == {}, r  # no amax, scale or any other collective
        assert sum(gathers.values()) == (2 if world > 1 else 0) == r["all_gathers"], r
        # Only the largest rank's bytes, rounded up to 16, travel per slot.
        assert r["slot_bytes"] % 16 == 0 and 0 <= r["slot_bytes"] - max(r["rank_bytes"]) < 16, r
    if world == 8:  # some ranks hold no tile of some tensors, or nothing at all
        assert min(results[0]["rank_bytes"]) < max(results[0]["rank_bytes"]), results[0]


def _rejections():
    mesh = get_mesh()
    out = {}
    q = veragged.BlockFP8()
    for label, make, fn in [
        ("int", lambda: _IntParam(), lambda n, p: q),
        ("dtype", lambda: nn.Linear(4, 4).double(), lambda n, p: q),
        ("returned", lambda: nn.Linear(4, 4), lambda n, p: "fp8"),
        ("chunked", lambda: nn.Linear(4, 4), lambda n, p: q),
    ]:
        kwargs = {}
        if label == "chunked":
            kwargs["shard_placement_fn"] = (
                lambda p: torch.distributed.tensor.Shard(1) if p.ndim == 2 else None)
        try:
            veragged.fully_shard(make(), mesh=mesh, quant_fn=fn, **kwargs)
            out[label] = None
        except (ValueError, TypeError, NotImplementedError) as e:
            out[label] = f"{type(e).__name__}: {e}"
    return out


class _IntParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, 4, dtype=torch.int32), requires_grad=False)


def test_bad_parameters_raise_naming_them():
    out = run_on_ranks(_rejections, 2)[0]
    assert "'w'" in out["int"] and "torch.int32" in out["int"], out
    assert "'weight'" in out["dtype"] and "torch.float64" in out["dtype"], out
    assert out["returned"].startswith("TypeError") and "'fp8'" in out["returned"], out
    assert "dim > 0" in out["chunked"] and "weight" in out["chunked"], out


def test_formats_check_their_arguments():
    with pytest.raises(ValueError, match="tile must be"):
        veragged.BlockFP8(tile=(128,))
    with pytest.raises(ValueError, match="scale must be one of"):
        veragged.BlockFP8(scale="e4m3")
    with pytest.raises(ValueError, match="rounding must be one of"):
        veragged.MXFP8(rounding="even")


def _combinations():
    """TP and all-gather extensions are refused naming the parameters; CPU offload works and
    gathers the same bytes as without it ([Note: block-scaled weights])."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from tests.fsdp.test_all_gather_extensions import BF16Weight

    q = veragged.BlockFP8()
    quant_fn = lambda n, p: q if p.ndim == 2 else None  # noqa: E731
    out = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_model = nn.Sequential(nn.Linear(16, 32))
    parallelize_module(tp_model, mesh["tp"], {"0": ColwiseParallel()})
    ext_model = nn.Linear(16, 16)
    ext_model.weight = nn.Parameter(BF16Weight(ext_model.weight.detach()))
    for label, model, m in (("tp", tp_model, mesh["dp"]), ("extension", ext_model, None)):
        try:
            veragged.fully_shard(model, mesh=m or get_mesh(), quant_fn=quant_fn)
            out[label] = None
        except (ValueError, TypeError, NotImplementedError) as e:
            out[label] = f"{type(e).__name__}: {e}"
    results = []
    for offload in (None, CPUOffloadPolicy(pin_memory=False)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(200, 300), nn.Linear(300, 10))
        kwargs = {} if offload is None else {"offload_policy": offload}
        veragged.fully_shard(model, mesh=get_mesh(), quant_fn=quant_fn, **kwargs)
        model.unshard()
        results.append([p.detach().clone() for p in model.parameters()])
        model.reshard()
    out["offload_same"] = all(torch.equal(a, b) for a, b in zip(*results))
    return out


def test_tp_and_extensions_are_refused_and_offload_gathers_the_same():
    for out in run_on_ranks(_combinations, 4, timeout=180):
        assert out["tp"].startswith("NotImplementedError") and "'0.weight'" in out["tp"], out
        assert out["extension"].startswith("NotImplementedError"), out
        assert "'weight'" in out["extension"] and "extension" in out["extension"], out
        assert out["offload_same"], out
