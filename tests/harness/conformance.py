"""Run torch's FSDP2 unit tests, ported to CPU/gloo, against torch's and veragged's fully_shard.

A ported test file imports `fully_shard`, `device_type` and `FSDPTest` from here instead of
torch (everything else stays torch's) and ends with `instantiate_conformance_tests(globals())`:

    from tests.harness.conformance import FSDPTest, fully_shard, instantiate_conformance_tests

    class TestFoo(FSDPTest):
        @property
        def world_size(self) -> int:
            return 2

        def test_bar(self):                      # runs on every rank of a persistent pool
            model = nn.Linear(4, 4)
            fully_shard(model)                   # torch's or veragged's, per class
            ...

    instantiate_conformance_tests(globals())     # -> TestFoo_torch, TestFoo_veragged

When pytest/unittest calls `TestFoo_veragged("test_bar").test_bar()` in the driver process, the
call is shipped to `get_pool(self.world_size)` (tests.harness.pool) as (file, module, class,
method, impl); each rank imports the test module from its file, selects the implementation,
seeds as torch's FSDPTest does (`set_rng_seed()`), calls the port's own `setUp`/`tearDown` if it
defines them, and runs the original method body. A port's `setUp`/`tearDown` only run on the
ranks, never in the driver. `unittest.SkipTest` raised on a rank skips the test. While a test
runs, torch's model zoo (`common_fsdp.fully_shard`, used by e.g. `MLPStack.parallelize`) shards
with the implementation under test too. The implementation under test and the stand-ins for
FSDP2's private pieces (`fully_shard`, `RegisterPostBackwardFunction`, `FSDPParamGroup` and
the patches) live in tests/harness/conformance_impl.py; they are re-exported here.

Also here: `distribute_tensor` (`veragged.distribute_tensor`, which knows RaggedShard and hands
torch's placements to torch's `distribute_tensor`, returning what it returns; ports that
distribute a full tensor with a sharded parameter's placements import it from here),
`check_sharded_parity` (torch's, distributing the reference with that `distribute_tensor`),
`torch_only(reason)` (skips a test that inspects FSDP2's private state on the veragged
class), `torch_fails(reason, before=None)` (skips, on the torch class, a test from a newer
torch that the installed torch's own fully_shard fails: always, or below torch `before`),
`RegisterPostBackwardFunction` and
`patch_register_post_backward_hook_backward` (FSDP2's private autograd function, or veragged's of
the same role, per class), `FSDPParamGroup` and `patch_unshard` / `patch_reshard` /
`patch_post_backward` (FSDP2's parameter group, or veragged's `ParamGroup` seen through
`_GroupView`, per class), `HardwareClassification` (torch's, or its members on a torch without
it), `fully_shard.state`, `compiled_fsdp_test` (torch's decorator, patching the dispatching
`fully_shard`), and
`FSDPTest.conformance_timeout_s` (per-class limit of one test, default 120 s; pytest-timeout's
limit is raised to match). Ports alias `FSDPTestMultiThread = FSDPTest`: ranks are processes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import os
import sys
import unittest
from enum import Enum, auto
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.testing._internal import common_fsdp
from torch.testing._internal.common_utils import TestCase, set_rng_seed

from veragged.placement import distribute_tensor
from tests.harness.conformance_impl import (
    STATE,
    FSDPParamGroup,
    RegisterPostBackwardFunction,
    fully_shard,
    impl_name,
    patch_post_backward,
    patch_register_post_backward_hook_backward,
    patch_reshard,
    patch_unshard,
)
from tests.harness.device import test_device
from tests.harness.pool import get_pool

__all__ = ["IMPLS", "DEFAULT_TIMEOUT_S", "FSDPParamGroup", "FSDPTest", "HardwareClassification",
           "RegisterPostBackwardFunction", "check_sharded_parity", "compiled_fsdp_test",
           "device_type", "distribute_tensor", "fully_shard", "impl_name",
           "instantiate_conformance_tests", "patch_post_backward",
           "patch_register_post_backward_hook_backward", "patch_reshard", "patch_unshard",
           "torch_fails", "torch_only"]

IMPLS = ("torch", "veragged")
DEFAULT_TIMEOUT_S = 120.0
_POOL_START_ALLOWANCE_S = 180.0  # pytest-timeout: the class's limit plus a (re)start of the pool
_PYTEST_TIMEOUT = importlib.util.find_spec("pytest_timeout") is not None
device_type = test_device()  # "cpu", or "cuda" under VERAGGED_TEST_DEVICE=cuda

# VERAGGED_CONFORMANCE_TORCH_ONLY=run runs the torch_only tests on veragged too (to audit the
# marks: each should fail there for the reason it gives, or its mark should go).
_RUN_TORCH_ONLY = os.environ.get("VERAGGED_CONFORMANCE_TORCH_ONLY", "") == "run"


# torch's tag of a test class's hardware (`hw_classification = HardwareClassification.GENERIC`),
# read only by torch's own runner to filter tests (`--hw-classification`). torch 2.11 has no such
# enum, and a port importing it from torch would be skipped whole there (conftest.py), so the
# ports import it from here: torch's where it exists, else one with torch's members.
try:
    from torch.testing._internal.common_utils import HardwareClassification
except ImportError:
    class HardwareClassification(Enum):  # torch 2.15's members
        GENERIC = "generic"
        ACCELERATOR = "accelerator"
        CPU = "cpu"
        CUDA = "cuda"
        MPS = "mps"
        XPU = "xpu"


def _code_of(fn: Any) -> Any:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(inspect.unwrap(fn), "__code__", None)


def _running(code: Any, depth: int = 64) -> bool:
    frame = sys._getframe(2)
    while frame is not None and depth > 0:
        if frame.f_code is code:
            return True
        frame, depth = frame.f_back, depth - 1
    return False


@contextlib.contextmanager
def _collectives_through_public_names():
    """While a test runs, the legacy names `dist.reduce_scatter_tensor` and
    `dist.all_gather_into_tensor` (in torch >= 2.15 aliases of `reduce_scatter_single` and
    `all_gather_single`) call those through the `torch.distributed` namespace, so torch's
    `patch_reduce_scatter` / `patch_all_gather` (which replace `dist.reduce_scatter_single` /
    `dist.all_gather_single`) see every reduce-scatter and all-gather of either implementation,
    whichever name it calls; unpatched, nothing changes. Called from inside the patched
    function (a port keeping `orig = dist.reduce_scatter_tensor`), a legacy name is torch's
    collective itself, so the patch runs once per collective. On a torch without the `_single`
    names, `_single_names_as_legacy` instead."""
    from torch.distributed import distributed_c10d as c10d

    if not hasattr(c10d, "reduce_scatter_single"):
        with _single_names_as_legacy():
            yield
        return
    pairs = [(legacy, single) for legacy, single in (
        ("reduce_scatter_tensor", "reduce_scatter_single"),
        ("all_gather_into_tensor", "all_gather_single"),
    ) if hasattr(c10d, single) and hasattr(dist, single)]
    originals = {legacy: getattr(dist, legacy) for legacy, _ in pairs}

    def forwarder(single: str) -> Callable:
        real = getattr(c10d, single)

        def call(*args: Any, **kwargs: Any) -> Any:
            patched = getattr(dist, single)
            if patched is real or _running(_code_of(patched)):
                return real(*args, **kwargs)
            return patched(*args, **kwargs)

        return call

    for legacy, single in pairs:
        setattr(dist, legacy, forwarder(single))
    try:
        yield
    finally:
        for legacy, original in originals.items():
            setattr(dist, legacy, original)


@contextlib.contextmanager
def _single_names_as_legacy():
    """On a torch without `reduce_scatter_single` / `all_gather_single` (2.11; newer ports call
    them, in `torch.distributed` and in its functional collectives), while a test runs those
    names are the older functions of the same parameters: `dist.reduce_scatter_tensor`,
    `dist.all_gather_into_tensor`, `funcol.reduce_scatter_tensor`, `funcol.all_gather_tensor`.
    That torch's `patch_reduce_scatter` / `patch_all_gather` patch the older names, which both
    implementations call, so a port's `orig = dist.reduce_scatter_single` is the unpatched
    collective, as on a newer torch."""
    import torch.distributed._functional_collectives as funcol

    aliases = [(module, single, getattr(module, legacy)) for module, single, legacy in (
        (dist, "reduce_scatter_single", "reduce_scatter_tensor"),
        (dist, "all_gather_single", "all_gather_into_tensor"),
        (funcol, "reduce_scatter_single", "reduce_scatter_tensor"),
        (funcol, "all_gather_single", "all_gather_tensor"),
    ) if not hasattr(module, single)]
    for module, single, fn in aliases:
        setattr(module, single, fn)
    try:
        yield
    finally:
        for module, single, _ in aliases:
            delattr(module, single)


def compiled_fsdp_test(compile_compute_on_module: Optional[type] = None):
    """torch's `common_fsdp.compiled_fsdp_test`, patching this module's dispatching
    `fully_shard` instead of torch's (torch's would replace the port's `fully_shard` global by
    torch's own for good). Same modes: eager, then compiled compute if Triton is usable."""
    from torch.utils._triton import has_triton

    def fully_shard_with_compiled_compute(*args, **kwargs):
        fully_shard(*args, **kwargs)
        if compile_compute_on_module is None or isinstance(args[0], compile_compute_on_module):
            args[0].compile()

    class FullyShardMode(Enum):
        EAGER = auto()
        COMPILED_COMPUTE = auto()

    def decorator(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            original = func.__globals__["fully_shard"]
            for mode in FullyShardMode:
                if mode != FullyShardMode.EAGER and not has_triton():
                    continue
                original_compile_threads = torch._inductor.config.compile_threads
                dist.barrier()
                if mode == FullyShardMode.COMPILED_COMPUTE:
                    torch._inductor.config.compile_threads = 1
                    func.__globals__["fully_shard"] = fully_shard_with_compiled_compute
                try:
                    func(*args, **kwargs)
                finally:
                    func.__globals__["fully_shard"] = original
                    torch._inductor.config.compile_threads = original_compile_threads
                dist.barrier()

        return wrapper

    return decorator


def check_sharded_parity(cls, replicated_module, sharded_module, prefixes_to_ignore=()):
    """torch's `common_fsdp.check_sharded_parity`, with the same assertions: each sharded
    parameter (and gradient) equals the replicated one distributed with the sharded one's mesh
    and placements. The reference is distributed by `veragged.distribute_tensor`, since torch's
    `distribute_tensor` rejects placements it does not define (RaggedShard); for torch's own
    placements it calls torch's."""
    from torch.distributed.tensor import DTensor, Shard

    for (replicated_name, replicated_param), (sharded_name, sharded_param) in zip(
        replicated_module.named_parameters(), sharded_module.named_parameters(), strict=True
    ):
        clean_sharded_name = sharded_name
        for prefix in prefixes_to_ignore:
            clean_sharded_name = clean_sharded_name.replace(prefix, "")
        cls.assertEqual(replicated_name, clean_sharded_name)
        cls.assertIsInstance(sharded_param, DTensor)
        mesh, placements = sharded_param.device_mesh, sharded_param.placements
        if tuple(placements) == (Shard(0), Shard(0)):
            raise AssertionError(
                "FSDP's (Shard(0), Shard(0)) layout differs from distribute_tensor(), "
                "so we cannot check for equality using it"
            )
        sharded_ref_param = distribute_tensor(replicated_param, mesh, placements)
        cls.assertEqual(sharded_param.to_local(), sharded_ref_param.to_local())
        if replicated_param.grad is None:
            cls.assertIsNone(sharded_param.grad)
            continue
        cls.assertIsNotNone(sharded_param.grad)
        sharded_ref_grad = distribute_tensor(replicated_param.grad, mesh, placements)
        cls.assertIsInstance(sharded_param.grad, DTensor)
        cls.assertEqual(sharded_param.grad.to_local(), sharded_ref_grad.to_local())


def torch_only(reason: str) -> Callable:
    """Mark a test that inspects torch internals (`Shard(0)` placements, FSDP2's private
    classes): its `_veragged` variant is skipped with `reason`."""

    def decorator(fn):
        fn._conformance_torch_only = reason
        return fn

    return decorator


def torch_fails(reason: str, *, before: str | None = None) -> Callable:
    """Mark a test, taken from a torch newer than the installed one, that the installed torch's
    own `fully_shard` fails (a bug fixed after it, a behaviour or API it lacks): its `_torch`
    variant is skipped with `reason`, on every torch or, with `before="2.15"`, on torch older
    than that; the `_veragged` variant runs."""

    def decorator(fn):
        if before is None or _torch_older_than(before):
            fn._conformance_torch_fails = reason
        return fn

    return decorator


def _torch_older_than(version: str) -> bool:
    """Whether the installed torch's release is older than `version` ("2.15")."""
    installed = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return installed < tuple(int(x) for x in version.split(".")[:2])


class FSDPTest(TestCase):
    """Stands in for torch's `common_fsdp.FSDPTest` and `FSDPTestMultiThread`.

    Test methods run on the ranks of `get_pool(self.world_size)`; `conformance_timeout_s`
    bounds each test (class attribute, override per class).
    """

    conformance_timeout_s: float = DEFAULT_TIMEOUT_S
    _conformance_impl: Optional[str] = None  # set on the classes instantiate_... generates
    device_type = device_type

    @property
    def world_size(self) -> int:
        return 2

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def process_group(self):
        return dist.distributed_c10d._get_default_group()

    def run_subtests(self, *args, **kwargs):
        return common_fsdp.run_subtests(self, *args, **kwargs)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name, attr in list(vars(cls).items()):
            if not callable(attr) or getattr(attr, "_conformance_wrapped", False):
                continue
            if name.startswith("test"):
                setattr(cls, name, _shipped(name, attr))
            elif name in ("setUp", "tearDown"):
                setattr(cls, name, _rank_only(name, attr))


def _shipped(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if STATE.in_rank:
            return fn(self, *args, **kwargs)
        cls = type(self)
        results = get_pool(self.world_size).run(
            _run_test, inspect.getfile(cls), cls.__module__, cls.__qualname__, self._testMethodName,
            cls._conformance_impl or "torch", timeout=cls.conformance_timeout_s)
        skips = [r for r in results if r is not None]
        if skips:
            raise unittest.SkipTest(skips[0])

    wrapper._conformance_wrapped = True
    return wrapper


def _rank_only(name: str, fn: Callable) -> Callable:
    """A port's setUp/tearDown: runs on the ranks; in the driver only TestCase's runs."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if STATE.in_rank:
            return fn(self, *args, **kwargs)
        return getattr(TestCase, name)(self)

    wrapper._conformance_wrapped = True
    return wrapper


def _import_test_module(path: str, module_name: str):
    """The test module as pytest imported it (its dir on sys.path, same module name)."""
    module = sys.modules.get(module_name)
    if module is not None and os.path.abspath(getattr(module, "__file__", "")) == path:
        return module
    test_dir = os.path.dirname(path)
    if test_dir not in sys.path:
        sys.path.insert(0, test_dir)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _run_test(path: str, module_name: str, qualname: str, method: str,
              impl: str) -> Optional[str]:
    """Rank side of a shipped test; returns None, or the reason if the test skipped itself."""
    cls = _import_test_module(os.path.abspath(path), module_name)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    STATE.impl, STATE.in_rank = impl, True
    zoo_fully_shard = common_fsdp.fully_shard  # MLPStack.parallelize etc. shard with it
    common_fsdp.fully_shard = fully_shard
    try:
        torch._dynamo.reset()
        set_rng_seed()  # as torch's FSDPTest does in each rank before the test
        test = cls(method)
        own_setup = getattr(cls.setUp, "_conformance_wrapped", False)
        own_teardown = getattr(cls.tearDown, "_conformance_wrapped", False)
        with _collectives_through_public_names():
            if own_setup:
                test.setUp()
            try:
                getattr(test, method)()
            finally:
                if own_teardown:
                    test.tearDown()
        torch._dynamo.reset()
    except unittest.SkipTest as exc:
        return str(exc) or "skipped"
    finally:
        STATE.impl, STATE.in_rank = "torch", False
        STATE.sharded.clear()
        common_fsdp.fully_shard = zoo_fully_shard
    return None


def instantiate_conformance_tests(scope: dict) -> None:
    """Replace every FSDPTest subclass defined in `scope` (a test module's `globals()`) by
    `<Name>_torch` and `<Name>_veragged`."""
    for name, base in list(scope.items()):
        if not (isinstance(base, type) and issubclass(base, FSDPTest) and base is not FSDPTest
                and base.__module__ == scope["__name__"] and base._conformance_impl is None):
            continue
        for impl in IMPLS:
            namespace = {"__module__": base.__module__, "__qualname__": f"{name}_{impl}",
                         "_conformance_impl": impl}
            if impl != "torch" and not _RUN_TORCH_ONLY:
                for attr_name in dir(base):
                    reason = getattr(getattr(base, attr_name), "_conformance_torch_only", None)
                    if attr_name.startswith("test") and reason is not None:
                        namespace[attr_name] = unittest.skip(f"torch_only: {reason}")(
                            getattr(base, attr_name))
            if impl == "torch":
                for attr_name in dir(base):
                    reason = getattr(getattr(base, attr_name), "_conformance_torch_fails", None)
                    if attr_name.startswith("test") and reason is not None:
                        namespace[attr_name] = unittest.skip(
                            f"torch {torch.__version__} fails it: {reason}")(
                            getattr(base, attr_name))
            if _PYTEST_TIMEOUT:  # pytest-timeout's limit follows the class's own
                import pytest
                namespace["pytestmark"] = [pytest.mark.timeout(
                    base.conformance_timeout_s + _POOL_START_ALLOWANCE_S)]
            scope[f"{name}_{impl}"] = type(f"{name}_{impl}", (base,), namespace)
        del scope[name]
