"""torchtitan 0.3.0 on CPU gloo ranks: the launcher of tests/clients/test_torchtitan.py.

`train(impl, module, config, args, folder)` runs torchtitan's own `Trainer` (built from its own
`ConfigManager` command line, trained by `Trainer.train`) on every rank of a pool and returns
the logged `(loss, grad_norm)` of each step. Nothing in site-packages is changed; what a CPU run
needs is patched here, for the run only where it touches torch or a shared module:

1. `torchtitan.tools.utils` picks its device when first imported (`_get_available_device_type()
   or "cuda"`): it is imported while that answers "cpu".
2. Its memory monitor calls `memory_stats`, `get_device_name`, `get_device_properties`,
   `reset_peak_memory_stats`, `empty_cache` on `torch.cpu`, which has none of them: the
   monitor's module gets `torch.cpu` plus stand-ins that report zero bytes.
3. `set_pg_timeouts` passes `device_ids=[torch.cpu.current_device()]` (the string "cpu") to
   `dist.barrier`, which gloo rejects: replaced by the same barrier and timeouts without ids.
4. FlexAttention has no CPU backward: its compiled kernel is replaced by eager attention that
   applies the same BlockMask's `mask_mod` densely (`create_mask`), and the BlockMask is made
   without `torch.compile` (an inductor build on CPU costs tens of seconds).
5. `Trainer.train` sleeps 2 s on rank 0 at the end: not here.
6. Its metrics and data modules import `torch.utils.tensorboard` and HF `datasets`; where those
   packages are absent, stand-ins serve the import (`datasets`: a JSON-lines `load_dataset`, a
   map-style `Dataset` and `split_dataset_by_node`; tensorboard is never enabled).
7. Expert parallelism exchanges tokens with spmd_types' uneven `dist.all_to_all` (a list of
   tensors of different sizes), which gloo rejects ("invalid tensor size"); spmd_types' own
   hook `spmd_types._dist.set_dist` gets torch.distributed with that one call done by
   `all_to_all_single` with split sizes (gloo's alltoallv, the same bytes).
8. `torchao`, if installed, is hidden while torchtitan is imported (torchao >= 0.13 builds
   Triton kernels at import, which fails on CPU-only machines).
9. `--checkpoint.async_mode async_with_pinned_mem` stages with `DefaultStager(StagingOptions(
   use_non_blocking_copy=True, ...))`, which torch refuses without an accelerator ("Non-blocking
   copy requires that the current accelerator is available"), for its own fully_shard too:
   torchtitan's checkpointer gets the same options with blocking copies (pinning is ignored on
   CPU by torch itself, with a warning); shared memory and asynchronous staging stay.

`impl="veragged"` swaps `fully_shard` for `veragged.fully_shard` in every torchtitan module
that imported torch's (its parallelize modules: `from torch.distributed.fsdp import
fully_shard`) and holds `veragged.route_torch_entry_points()`, for the run only: the two lines
a torchtitan user adds; `quant=` a `veragged.BlockFP8`/`MXFP8` binds `quant_fn` into that
fully_shard, giving the format to the Linear weights of the transformer blocks
(`block_linear_quant_fn`). `impl="torch"` keeps torch's, and after building sets
`set_force_sum_reduction_for_comms(True)` on its FSDPModules: torchtitan sets a gradient divide
factor of 1.0, which makes torch's FSDP2 reduce with `ReduceOp.PREMUL_SUM`, a reduction gloo
does not have (a sum with factor 1 is the same sum). veragged needs no such line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import importlib.abc
import json
import os
import sys
import types
from unittest import mock

import torch
import torch.distributed as dist

_MODELS = ("llama3", "deepseek_v3")
_TITAN: dict = {}


# ---- stand-ins for packages torchtitan imports but a CPU test does not use ---------------------

class _Dataset:
    """Map-style rows, the part of `datasets.Dataset` torchtitan's text dataset uses."""

    def __init__(self, rows):
        self._rows = list(rows)

    def __len__(self):
        return len(self._rows)

    def __iter__(self):
        return iter(self._rows)

    def skip(self, n):
        return _Dataset(self._rows[n:])

    def shuffle(self, seed):
        import random

        rows = list(self._rows)
        random.Random(seed).shuffle(rows)
        return _Dataset(rows)


def _load_dataset(path, name=None, split="train", streaming=False, **_):
    files = sorted(f for f in os.listdir(path) if f.startswith(split) and f.endswith(".jsonl"))
    if not files:
        raise FileNotFoundError(f"no {split}*.jsonl under {path!r}")
    rows = []
    for f in files:
        with open(os.path.join(path, f)) as fh:
            rows.extend(json.loads(line) for line in fh if line.strip())
    return _Dataset(rows)


def _split_dataset_by_node(ds, rank, world_size):
    """Contiguous shards, as `datasets` splits a map-style dataset."""
    n = len(ds)
    per, extra = divmod(n, world_size)
    start = rank * per + min(rank, extra)
    return _Dataset(list(ds)[start:start + per + (rank < extra)])


def _stand_ins() -> dict[str, types.ModuleType]:
    mods = {}
    try:
        import datasets  # noqa: F401
    except ImportError:
        ds = types.ModuleType("datasets")
        ds.Dataset, ds.load_dataset = _Dataset, _load_dataset
        ds.IterableDataset = type("IterableDataset", (), {})
        dist_mod = types.ModuleType("datasets.distributed")
        dist_mod.split_dataset_by_node = _split_dataset_by_node
        ds.distributed = dist_mod
        mods.update({"datasets": ds, "datasets.distributed": dist_mod})
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        tb = types.ModuleType("torch.utils.tensorboard")

        class SummaryWriter:  # only built with --metrics.enable_tensorboard
            def __init__(self, *a, **k):
                raise RuntimeError("tensorboard is not installed")

        tb.SummaryWriter = SummaryWriter
        mods["torch.utils.tensorboard"] = tb
    return mods


class _Hide(importlib.abc.MetaPathFinder):
    """Makes `import torchao` (and its submodules) fail as if it were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchao" or name.startswith("torchao."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden for torchtitan)")
        return None


def _titan() -> dict:
    """Import torchtitan once per process with the device answering "cpu" (patch 1, 6, 8)."""
    if _TITAN:
        return _TITAN
    stand_ins = _stand_ins()
    added = [k for k in stand_ins if k not in sys.modules]
    sys.modules.update({k: stand_ins[k] for k in added})
    hide = _Hide()
    sys.meta_path.insert(0, hide)
    try:
        with mock.patch("torch._utils._get_available_device_type", return_value="cpu"):
            import torchtitan.tools.utils as utils

            assert utils.device_type == "cpu", utils.device_type
            import torchtitan.components.checkpointer.dcp as checkpointer
            import torchtitan.components.metrics as metrics
            import torchtitan.distributed.utils as dist_utils
            import torchtitan.models.common.attention as attention
            import torchtitan.models.common.decoder as decoder
            import torchtitan.trainer as trainer
            from torchtitan.config import ConfigManager

            for name in _MODELS:
                __import__(f"torchtitan.models.{name}.config_registry")
                __import__(f"torchtitan.models.{name}.parallelize")
    finally:
        sys.meta_path.remove(hide)
        for k in added:  # torchtitan keeps the names it imported; nothing else sees them
            sys.modules.pop(k, None)
    _TITAN.update(utils=utils, metrics=metrics, dist_utils=dist_utils, attention=attention,
                  decoder=decoder, trainer=trainer, checkpointer=checkpointer,
                  ConfigManager=ConfigManager)
    return _TITAN


# ---- CPU replacements (patches 2-5, 7) -----------------------------------------------------------

class _CpuMemory(types.ModuleType):
    """`torch.cpu` plus the memory-monitor calls it lacks (zero bytes used, 0 retries)."""

    def __init__(self):
        super().__init__("torch_cpu_for_torchtitan")

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device=None):
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        return types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE")
                                     * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device=None):
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None):
        return None

    @staticmethod
    def empty_cache():
        return None


def _set_pg_timeouts(timeout, parallel_dims):
    """torchtitan's set_pg_timeouts without the accelerator device id in the barrier."""
    dist.barrier()
    groups = [mesh.get_group()
              for mesh in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
    for group in groups:
        dist.set_timeout(timeout, group)


def _eager_flex_attention(q, k, v, *, score_mod=None, block_mask=None, scale=None,
                          enable_gqa=False, return_aux=None, kernel_options=None):
    """flex_attention's math on (B, N, L, H) inputs with the BlockMask's mask_mod applied densely.

    Returns `(out, aux)` like the compiled kernel; `aux.lse` (natural-log logsumexp of the
    scaled scores, as flex_attention's) when asked.
    """
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    assert score_mod is None, "the CPU attention takes no score_mod"
    batch, heads, q_len, dim = q.shape
    if enable_gqa and k.shape[1] != heads:
        rep = heads // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = dim ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)).float() * scale
    if block_mask is not None:
        mask = create_mask(block_mask.mask_mod, batch, None, q_len, k.shape[2], device=q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.softmax(scores, dim=-1).to(v.dtype) @ v)
    want_lse = return_aux is not None and getattr(return_aux, "lse", False)
    return out, AuxOutput(lse=lse if want_lse else None)


class _GlooDist(types.ModuleType):
    """torch.distributed, except `all_to_all` of unequal tensors (gloo: alltoallv)."""

    def __init__(self):
        super().__init__("torch_distributed_for_spmd_types")

    def __getattr__(self, name):
        return getattr(dist, name)

    @staticmethod
    def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
        assert not async_op, "the CPU all_to_all is synchronous"
        flat_in = torch.cat([t.reshape(-1) for t in input_tensor_list])
        flat_out = flat_in.new_empty(sum(t.numel() for t in output_tensor_list))
        dist.all_to_all_single(flat_out, flat_in, [t.numel() for t in output_tensor_list],
                               [t.numel() for t in input_tensor_list], group=group)
        for out, piece in zip(output_tensor_list, flat_out.split(
                [t.numel() for t in output_tensor_list])):
            out.copy_(piece.view_as(out))


@contextlib.contextmanager
def _spmd_dist():
    from spmd_types import _dist

    before = _dist.dist
    _dist.set_dist(_GlooDist())
    try:
        yield
    finally:
        _dist.set_dist(before)


def _cpu_staging_options(*args, **kwargs):
    """torch's StagingOptions with blocking copies (patch 9)."""
    from torch.distributed.checkpoint.staging import StagingOptions

    options = StagingOptions(*args, **kwargs)
    options.use_non_blocking_copy = False
    return options


def _uncompiled_block_mask(*args, **kwargs):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(*args, **kwargs)


def block_linear_quant_fn(fmt, fqn: str, param) -> object | None:
    """`fmt` for the weight of a Linear of a transformer block's attention or feed-forward
    (llama3: `attention.qkv_linear.wqkv`, `attention.wo`, `feed_forward.w1`/`w2`/`w3`), None
    for the rest (embedding, norms, lm_head). torchtitan shards each block on its own, so the
    names are relative to the block, behind activation checkpointing's
    `_checkpoint_wrapped_module.` when it wraps the block; its other fully_shard calls name no
    such parameter."""
    parts = [p for p in fqn.split(".") if p != "_checkpoint_wrapped_module"]
    if parts[0] in ("attention", "feed_forward") and parts[-1] == "weight" and param.ndim == 2:
        return fmt
    return None


@contextlib.contextmanager
def _cpu_run(titan: dict, impl: str, quant=None):
    """The patches of one run (2-5, 7, and veragged's fully_shard where asked, with `quant_fn`
    for the format `quant`); undone after."""
    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world)}
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, env))
        stack.enter_context(mock.patch.object(titan["metrics"], "device_module", _CpuMemory()))
        stack.enter_context(mock.patch.object(titan["dist_utils"], "set_pg_timeouts",
                                              _set_pg_timeouts))
        stack.enter_context(mock.patch.object(titan["attention"].FlexAttention,
                                              "_compiled_flex_attn", _eager_flex_attention))
        stack.enter_context(_spmd_dist())
        stack.enter_context(mock.patch.object(titan["decoder"], "create_attention_mask",
                                              _uncompiled_block_mask))
        stack.enter_context(mock.patch.object(titan["checkpointer"], "StagingOptions",
                                              _cpu_staging_options))
        stack.enter_context(mock.patch.object(
            titan["trainer"], "time",
            types.SimpleNamespace(perf_counter=__import__("time").perf_counter,
                                  monotonic=__import__("time").monotonic,
                                  sleep=lambda s: None)))
        if impl == "veragged":
            import veragged
            from torch.distributed.fsdp import fully_shard as torch_fully_shard

            ours = veragged.fully_shard if quant is None else functools.partial(
                veragged.fully_shard, quant_fn=functools.partial(block_linear_quant_fn, quant))
            swapped = 0
            for name, mod in list(sys.modules.items()):
                if name.startswith("torchtitan") and \
                        getattr(mod, "fully_shard", None) is torch_fully_shard:
                    stack.enter_context(mock.patch.object(mod, "fully_shard", ours))
                    swapped += 1
            assert swapped, "no torchtitan module imported torch's fully_shard"
            stack.enter_context(veragged.route_torch_entry_points())
        elif impl != "torch":
            raise ValueError(f"impl must be 'torch' or 'veragged', got {impl!r}")
        elif quant is not None:
            raise ValueError("quant= needs impl='veragged' (torch's fully_shard has no quant_fn)")
        gc_was = gc.isenabled()
        try:
            yield
        finally:
            if gc_was:  # torchtitan's GarbageCollection disables the collector
                gc.enable()


def _cli(module: str, config: str, args: list[str]) -> list[str]:
    """torchtitan's command line; `args` end it (a tyro subcommand such as
    `activation-checkpoint:none` must follow every option)."""
    return ["--module", module, "--config", config, *args]


def make_seed(module: str, config: str, args: list[str], folder: str) -> None:
    """torchtitan's seed checkpoint (`--checkpoint.create_seed_checkpoint`) in `folder`.

    torchtitan writes it from one process; here every rank builds the same unsharded model
    (same seed, no parallelize) and DCP writes it once.
    """
    titan = _titan()
    cli = _cli(module, config, ["--dump_folder", folder, "--checkpoint.enable",
                                "--checkpoint.folder", "seed",
                                "--checkpoint.create_seed_checkpoint",
                                "--checkpoint.last_save_model_only", *args])
    with _cpu_run(titan, "torch"):
        cfg = titan["ConfigManager"]().parse_args(cli)
        trainer = cfg.build()
        try:
            trainer.checkpointer.save(curr_step=0, last_step=True)
        finally:
            trainer.close()


def train(impl: str, module: str, config: str, args: list[str], folder: str,
          full_params: bool = False, quant=None) -> dict:
    """Train with torchtitan's Trainer from the seed checkpoint in `folder`; the logged metrics.

    Returns {"loss": [...], "grad_norm": [...], "shards": {kind: count}, "params": ...,
    "quant_stats": [...]} where `shards` counts the placements of the sharded parameters (to
    show which fully_shard ran), `params` is, on rank 0 with `full_params`, every trained
    parameter in full (else None), and `quant_stats` this rank's `quant_stats()` of the model
    after training, as dicts (empty unless `quant`, a veragged format for the blocks' Linear
    weights: `block_linear_quant_fn`; impl="veragged" only).
    """
    run = os.path.join(folder, f"run_{impl}" + ("" if quant is None else "_quant"))
    return _train(impl, _cli(module, config, [
        "--dump_folder", run, "--checkpoint.enable", "--checkpoint.folder",
        os.path.join(folder, "seed"), "--checkpoint.load_only", *args]), full_params, quant)


def train_saving(impl: str, module: str, config: str, args: list[str], folder: str,
                 run: str) -> dict:
    """`train`, starting from the seed checkpoint in `folder` unless the run's own checkpoint
    folder (`folder/run/checkpoint`) holds one (then from it: `--checkpoint.load_step` in
    `args` picks which), saving there as `args` ask (`--checkpoint.interval`,
    `--checkpoint.async_mode`)."""
    return _train(impl, _cli(module, config, [
        "--dump_folder", os.path.join(folder, run), "--checkpoint.enable",
        "--checkpoint.initial_load_path", os.path.join(folder, "seed", "step-0"),
        "--checkpoint.no-last-save-model-only", *args]))


def _train(impl: str, cli: list[str], full_params: bool = False, quant=None) -> dict:
    titan = _titan()
    losses, norms = [], []
    with _cpu_run(titan, impl, quant):
        cfg = titan["ConfigManager"]().parse_args(cli)
        trainer = cfg.build()
        try:
            if impl == "torch":
                from torch.distributed.fsdp import FSDPModule

                for part in trainer.model_parts:
                    for m in part.modules():
                        if isinstance(m, FSDPModule):
                            m.set_force_sum_reduction_for_comms(True)
            log = trainer.metrics_processor.log

            def record(step, loss, max_loss, grad_norm, *a, **k):
                losses.append(float(loss))
                norms.append(float(grad_norm))
                return log(step, loss, max_loss, grad_norm, *a, **k)

            trainer.metrics_processor.log = record
            shards: dict[str, int] = {}
            for part in trainer.model_parts:
                for p in part.parameters():
                    kind = type(p.data).__name__ + ":" + ",".join(
                        type(pl).__name__ for pl in getattr(p, "placements", ()))
                    shards[kind] = shards.get(kind, 0) + 1
            trainer.train()
            params = None
            if full_params:
                params = {name: p.detach().full_tensor().clone()
                          for part in trainer.model_parts for name, p in part.named_parameters()}
            quant_stats = [dataclasses.asdict(s) for part in trainer.model_parts
                           if hasattr(part, "quant_stats") for s in part.quant_stats()]
        finally:
            trainer.close()
    if dist.get_rank() != 0:
        params = None
    return {"loss": losses, "grad_norm": norms, "shards": shards, "params": params,
            "quant_stats": quant_stats}
