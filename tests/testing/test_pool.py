"""Tests for tests.harness.pool: run_on_ranks calls share a pool's ranks, each starts as a
fresh call would (seeded, with its mesh), and a job's process groups do not outlive it."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tests.harness import get_mesh, run_on_ranks


def _pid_and_draw():
    return os.getpid(), torch.randn(8)


def _threads():
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def _redistribute_on_2x2():
    # A 2-D mesh's two dimension groups, and a redistribution: torch caches its transform
    # plan keyed by the specs, which hold the mesh (and through it the groups) past the job.
    mesh = get_mesh()
    x = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0), Replicate()])
    full = x.redistribute(mesh, [Replicate(), Shard(1)]).full_tensor()
    return torch.equal(full, torch.arange(16.0).reshape(4, 4)), dist.get_world_size()


def test_calls_share_the_pool_and_each_starts_seeded():
    first = run_on_ranks(_pid_and_draw, 2)
    second = run_on_ranks(_pid_and_draw, 2)
    assert [pid for pid, _ in first] == [pid for pid, _ in second]  # the same processes
    torch.manual_seed(0)
    expected = torch.randn(8)
    for _, draw in first + second:  # seeded like a fresh process at every call
        assert torch.equal(draw, expected)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_jobs_groups_do_not_outlive_it():
    # Every live gloo group keeps threads that wake up every 10 ms; the pool destroys a job's
    # groups and drops the references torch's caches keep to them through the mesh.
    before = run_on_ranks(_threads, 4)
    for _ in range(2):
        assert run_on_ranks(_redistribute_on_2x2, 4, mesh_shape=(2, 2)) == [(True, 4)] * 4
    assert run_on_ranks(_threads, 4) == before
