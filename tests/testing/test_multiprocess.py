"""Tests for tests.harness.run_on_ranks: results, collectives, meshes, failures and hangs.

run_on_ranks runs its calls on the session's rank pools (tests.harness.pool) unless
`fresh=True` spawns processes for the call; the failure reports are checked on both paths."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import MultiRankError, get_mesh, run_on_ranks

# Workers live at module level: the spawned ranks re-import this module to unpickle them.


def _rank_info(offset):
    return dist.get_rank() + offset, dist.get_world_size(), torch.get_num_threads()


def _all_reduce_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _random_tensor():
    return torch.randn(1 << 20)  # 4 MiB: larger than a pipe buffer


def _mesh_info():
    mesh = get_mesh()
    return {
        "shape": tuple(mesh.shape),
        "names": mesh.mesh_dim_names,
        "dp_ranks": dist.get_process_group_ranks(mesh["dp"].get_group()),
        "tp_ranks": dist.get_process_group_ranks(mesh["tp"].get_group()),
        "coord": mesh.get_coordinate(),
    }


def _raise_on(bad_ranks):
    if dist.get_rank() in bad_ranks:
        raise ValueError(f"boom from rank {dist.get_rank()}")
    t = torch.ones(1)
    dist.all_reduce(t)  # the healthy ranks block here until the failing rank is gone
    dist.barrier()
    return t.item()


def _hang_in_collective(marker_dir):
    open(os.path.join(marker_dir, f"rank{dist.get_rank()}"), "w").close()  # reached fn
    if dist.get_rank() == 0:
        time.sleep(3600)  # never joins the collective
    dist.all_reduce(torch.ones(1))


def _exit_without_exception():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _segfault():
    os.kill(os.getpid(), signal.SIGSEGV)


def _return_unpicklable():
    return lambda: None


@pytest.mark.parametrize("world_size, fresh", [(1, False), (2, False), (4, False), (2, True)])
def test_results_are_returned_per_rank(world_size, fresh):
    results = run_on_ranks(_rank_info, world_size, args=(100,), fresh=fresh)
    assert results == [(100 + r, world_size, 1) for r in range(world_size)]


def test_all_reduce_sums_over_four_ranks():
    assert run_on_ranks(_all_reduce_sum, 4, kwargs={}) == [10.0] * 4


def test_ranks_are_seeded_identically_and_large_results_come_back():
    first, second = run_on_ranks(_random_tensor, 2)
    torch.manual_seed(0)
    assert torch.equal(first, second) and torch.equal(first, torch.randn(1 << 20))


def test_two_by_two_mesh():
    infos = run_on_ranks(_mesh_info, 4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
    for rank, info in enumerate(infos):
        dp_coord, tp_coord = divmod(rank, 2)
        assert info["shape"] == (2, 2)
        assert info["names"] == ("dp", "tp")
        assert list(info["coord"]) == [dp_coord, tp_coord]
        assert info["dp_ranks"] == [tp_coord, tp_coord + 2]  # same tp index, every dp index
        assert info["tp_ranks"] == [2 * dp_coord, 2 * dp_coord + 1]


@pytest.mark.parametrize("fresh", [False, True])
def test_one_failing_rank_is_reported_quickly(fresh):
    start = time.monotonic()
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(_raise_on, 3, args=({1},), timeout=120, fresh=fresh)
    assert time.monotonic() - start < 60  # the blocked ranks are killed, not waited for
    message = str(info.value)
    assert isinstance(info.value, AssertionError)
    assert "----- rank 1 -----" in message and "(rank 1 first)" in message
    assert "Traceback (most recent call last)" in message
    assert "ValueError: boom from rank 1" in message
    assert "in _raise_on" in message  # the traceback points into the worker


def test_every_failing_rank_is_reported():
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(_raise_on, 2, args=({0, 1},), timeout=60)
    message = str(info.value)
    assert "boom from rank 0" in message and "boom from rank 1" in message
    assert {0, 1} <= set(info.value.failures)


@pytest.mark.parametrize("fresh", [False, True])
def test_hung_ranks_are_killed_at_the_timeout(tmp_path, fresh):
    if not fresh:  # the pool's start-up is not the call's: start it before the clock
        run_on_ranks(_rank_info, 2, args=(0,))
    start, wall = time.monotonic(), time.time()
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(_hang_in_collective, 2, timeout=8, args=(str(tmp_path),), fresh=fresh)
    assert time.monotonic() - start < 25
    message = str(info.value)
    assert "timed out after 8 s" in message and "ranks [0, 1] did not finish" in message
    # On a loaded machine the ranks may still be starting at the timeout (a rank may even reach
    # the job between the stack dump and the kill); ranks that were in the job before the
    # timeout fired show in their stacks (dumped on SIGUSR1) where they hang.
    markers = [os.path.join(tmp_path, f) for f in os.listdir(tmp_path)]
    if hasattr(signal, "SIGUSR1") and len(markers) == 2 and all(
            os.path.getmtime(m) < wall + 8 for m in markers):
        assert "_hang_in_collective" in info.value.failures[0]
        assert "all_reduce" in info.value.failures[1]


@pytest.mark.parametrize("fresh", [False, True])
def test_rank_dying_without_exception_reports_exit_code(fresh):
    start = time.monotonic()
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(_exit_without_exception, 2, timeout=120, fresh=fresh)
    assert time.monotonic() - start < 60
    assert "rank 1" in str(info.value) and "exit code 3" in str(info.value)


@pytest.mark.skipif(not hasattr(signal, "SIGSEGV"), reason="needs POSIX signals")
@pytest.mark.parametrize("fresh", [False, True])
def test_crashing_rank_reports_signal_and_stack(fresh):
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(_segfault, 1, timeout=120, fresh=fresh)
    assert "killed by SIGSEGV" in info.value.failures[0]
    assert "_segfault" in info.value.failures[0]  # faulthandler's dump of the crash
    if hasattr(torch._C, "_set_print_stack_traces_on_fatal_signal"):  # torch's C++ stacks
        assert "C++ stacks at the crash:\nSIGSEGV(11)" in info.value.failures[0]


@pytest.mark.parametrize("fresh", [False, True])
def test_unpicklable_result_is_reported(fresh):
    with pytest.raises(MultiRankError, match="return value of fn is not picklable"):
        run_on_ranks(_return_unpicklable, 1, timeout=60, fresh=fresh)


@pytest.mark.parametrize(
    "world_size, shape, names, pattern",
    [
        (4, (3,), None, r"mesh_shape \(3,\) has 3 ranks but world_size is 4"),
        (4, (2, 3), None, r"\(2, 3\) has 6 ranks but world_size is 4"),
        (8, (2, 2, 2), None, "1 or 2 positive dimensions"),
        (4, (2, 2), ("dp",), "must name each of the 2 dimensions"),
        (0, None, None, "world_size must be a positive int"),
    ],
)
def test_bad_arguments_raise_value_error(world_size, shape, names, pattern):
    with pytest.raises(ValueError, match=pattern):
        run_on_ranks(_rank_info, world_size, mesh_shape=shape, mesh_dim_names=names)


def test_unpicklable_fn_raises_type_error():
    with pytest.raises(TypeError, match="picklable"):
        run_on_ranks(lambda: None, 1)


def test_get_mesh_outside_ranks_raises():
    with pytest.raises(RuntimeError, match="only available inside"):
        get_mesh()
