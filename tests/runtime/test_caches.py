"""The cache registry ([Note: module caches], veragged/runtime/caches.py): every module-level
cache is registered under its own name, and `clear()` empties each one."""

import functools

import pytest
from torch.distributed.device_mesh import DeviceMesh

import veragged  # noqa: F401 - registers every cache
from veragged.dbuffer import tp_param
from veragged.placement import fastpath, tensor
from veragged.runtime import caches


def test_the_caches_the_pool_used_to_clear_by_name_are_registered():
    mesh = object.__new__(DeviceMesh)  # only its identity is used as a key
    tensor._SPECS[("probe",)] = mesh
    fastpath._NORM_SPECS[("probe",)] = mesh
    tp_param._MESHES[("probe",)] = mesh
    caches.clear()
    assert ("probe",) not in tensor._SPECS
    assert ("probe",) not in fastpath._NORM_SPECS
    assert ("probe",) not in tp_param._MESHES


def test_clear_empties_lru_caches_too():
    from veragged.placement.boxes import row_boxes

    row_boxes((4, 3), 1, 7)
    assert row_boxes.cache_info().currsize > 0
    caches.clear()
    assert row_boxes.cache_info().currsize == 0
    assert row_boxes((4, 3), 1, 7) == row_boxes.__wrapped__((4, 3), 1, 7)


def test_names_are_unique_and_say_where():
    names = caches.names()
    assert len(names) == len(set(names)) >= 17
    assert all(name.split(" ")[0].split(".")[0] in
               {"placement", "planner", "dbuffer", "fsdp", "optim"} for name in names), names
    with pytest.raises(ValueError, match="already registered"):
        caches.register(names[0], {})


def test_register_function_returns_the_function():
    @caches.register_function("tests.runtime probe")
    @functools.lru_cache(maxsize=4)
    def square(x):
        return x * x

    try:
        assert square(3) == 9 and square.cache_info().currsize == 1
        caches.clear()
        assert square.cache_info().currsize == 0
    finally:
        caches._CLEARS.pop("tests.runtime probe")
