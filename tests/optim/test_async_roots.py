"""Background roots and bases with an exact delay ([Note: asynchronous roots]): Shampoo's and
SOAP's refresh of step s installed at step s + k whatever the timing, bitwise equal to a
reference that runs every refresh at once and holds it k steps (no threads); waits counted,
errors raised on every rank, exit never held, checkpoints with refreshes in flight."""

import os
import re
import subprocess
import sys
import time

import pytest
import torch

from veragged.optim import SOAP, Shampoo
from veragged.optim.async_roots import AsyncStats
from tests.harness import get_mesh, run_on_ranks
from tests.harness.grads import set_grads

from matrix_cases import (
    FACTORIES,
    full_values,
    load_checkpoint,
    model,
    save_checkpoint,
    step_with_reference,
)


class QueueWorker:
    """The reference's worker: each refresh runs when it is submitted, on the main thread;
    its results wait in the optimizer's pending state until the install step."""

    def __init__(self):
        self.jobs, self.stats = set(), AsyncStats()

    def submit(self, key, run, device):
        run()
        self.jobs.add(key)

    def __contains__(self, key):
        return key in self.jobs

    def wait(self, key, stall=True):
        return None

    def forget(self, key, age=None):
        self.jobs.discard(key)

    def drain(self):
        return {}

    def in_flight(self):
        return list(self.jobs)

    def close(self):
        pass


SETTINGS = {  # (name, f) -> the optimizer's keywords
    ("shampoo", 1): dict(precondition_frequency=1, start_preconditioning_step=1),
    ("shampoo", 3): dict(precondition_frequency=3, start_preconditioning_step=3),
    ("soap", 3): dict(precondition_frequency=3),
}


def _make(name, m, f, k, reference=False, **kw):
    opt = FACTORIES[name](m, async_precondition=k > 0, staleness=k, **SETTINGS[name, f], **kw)
    if reference and k:
        opt._roots = QueueWorker()
    return opt


def _single_run(name, f, k, steps, delay=0.0, reference=False):
    m = model("single", None)
    opt = _make(name, m, f, k, reference)
    if delay:
        opt._roots.delay[0] = delay
    params = list(m.parameters())
    for step in range(steps):
        set_grads(params, step)
        opt.step()
    return [p.detach().clone() for p in params], opt


# ---- one process -------------------------------------------------------------------------------


@pytest.mark.parametrize("name,f", [("shampoo", 1), ("shampoo", 3), ("soap", 3)])
def test_staleness_0_is_the_synchronous_optimizer(name, f):
    async_params, _ = _single_run(name, f, 0, 30)
    m = model("single", None)
    opt = FACTORIES[name](m, **SETTINGS[name, f])  # async_precondition off
    for step in range(30):
        set_grads(list(m.parameters()), step)
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(async_params, m.parameters()))


@pytest.mark.parametrize("name,f,k", [("shampoo", 1, 1), ("shampoo", 3, 3), ("soap", 3, 1),
                                      ("soap", 3, 3)])
def test_installs_happen_at_submit_step_plus_k(name, f, k):
    """Which refresh is installed at which of the matrix's steps, recorded, against the rule
    written here: Shampoo refreshes at its steps f, 2f, ... (start = f), SOAP at calls f, 2f,
    ... of its counter; each installed k steps later, never before, none skipped."""
    m = model("single", None)
    opt = _make(name, m, f, k)
    seen = []
    take = opt._take

    def recording(mat, job, s, t):
        got = take(mat, job, s, t)
        seen.append((mat.label, job, s, t, got))
        return got

    opt._take = recording
    steps = 14
    for step in range(steps):
        set_grads(list(m.parameters()), step)
        opt.step()
    assert seen and all(got for *_, got in seen)
    assert all(t - s == k for _, _, s, t, _ in seen)
    last = steps if name == "shampoo" else steps - 1  # Shampoo counts from 1, SOAP from 0
    want_s = {s for s in range(f, last - k + 1, f)}
    assert {s for _, _, s, _, _ in seen} == want_s
    per_matrix = {}
    for label, job, s, _, _ in seen:
        per_matrix.setdefault((label, job), []).append(s)
    assert all(sorted(v) == sorted(want_s) for v in per_matrix.values())
    stats = opt.async_stats
    assert stats["max_age"] == k and stats["installed"] == len(seen)


def _small_run(name, f, k, steps, delay=0.0, reference=False):
    """A few plain parameters (two matrices, a vector): steps of a millisecond or two."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(12, 8), (6, 6), (5,)]]
    opt = (Shampoo if name == "shampoo" else SOAP)(
        params, async_precondition=k > 0, staleness=k, **SETTINGS[name, f])
    if reference:
        opt._roots = QueueWorker()
    else:
        opt._roots.delay[0] = delay
    g = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return [p.detach().clone() for p in params], opt, sorted(times)[len(times) // 2]


def test_slow_worker_waits_and_stays_bitwise():
    """Every job sleeps at least 3 step times: install steps wait (counted), the numbers do not
    move, over 200 steps; and an instant worker with k = f installs nothing early."""
    ref, _, step_s = _small_run("shampoo", 1, 1, 200, reference=True)
    got, opt, _ = _small_run("shampoo", 1, 1, 200, delay=max(3 * step_s, 0.002))
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    stats = opt.async_stats
    assert stats["stalls"] > 0 and stats["stall_seconds"] > 0 and stats["max_age"] == 1, stats
    for name in ("shampoo", "soap"):
        ref, _, _ = _small_run(name, 3, 3, 30, reference=True)
        got, opt, _ = _small_run(name, 3, 3, 30)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), name
        assert opt.async_stats["max_age"] == 3


@pytest.mark.parametrize("n", [1, 5, 24, 67])
def test_root_and_basis_ops_are_their_python_twins(n):
    """veragged::inverse_root_ and refresh_eigenbasis_ (one op each, for the workers) are
    bitwise kronecker.inverse_root and refresh_eigenbasis; a failed eigh gives NaN."""
    from veragged.optim import kronecker

    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, n + 3, generator=g)
    factor = x @ x.T
    out = torch.empty_like(factor)
    kronecker.inverse_root_into(out, factor, 4, 1e-12)
    assert torch.equal(out, kronecker.inverse_root(factor, 4, 1e-12))
    q = torch.linalg.qr(torch.randn(n, n, generator=g))[0]
    basis, order = torch.empty_like(q), torch.empty(n, dtype=torch.int64)
    kronecker.refresh_eigenbasis_into(basis, order, factor, q)
    want_basis, want_order = kronecker.refresh_eigenbasis(factor, q)
    assert torch.equal(basis, want_basis) and torch.equal(order, want_order)
    kronecker.inverse_root_into(out, torch.full((n, n), float("nan")), 4, 1e-12)
    assert not torch.isfinite(out).any()
    with pytest.raises(RuntimeError, match="order must be int64"):
        kronecker.refresh_eigenbasis_into(basis, order.int(), factor, q)


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_add_param_group_and_state_dict_with_jobs_in_flight(name):
    """A new param group (a new plan) and a state_dict round trip while slow jobs run: the
    runs stay bitwise the reference's, which does the same with its jobs done at submit."""
    def run(reference):
        torch.manual_seed(0)
        first = [torch.nn.Parameter(torch.randn(s)) for s in [(12, 8), (6, 6)]]
        later = [torch.nn.Parameter(torch.randn(9, 7))]
        opt = (Shampoo if name == "shampoo" else SOAP)(
            first, async_precondition=True, staleness=2, **SETTINGS[name, 3])
        if reference:
            opt._roots = QueueWorker()
        else:
            opt._roots.delay[0] = 0.02
        g = torch.Generator().manual_seed(1)
        for step in range(12):
            if step == 4:  # the refresh of counter 3 (Shampoo) or 3 (SOAP) is in flight
                opt.add_param_group({"params": later})
            if step == 8:
                opt.load_state_dict(opt.state_dict())
            for p in first + (later if step >= 4 else []):
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        return [p.detach().clone() for p in first + later]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_arguments_are_checked():
    m = model("single", None)
    groups = FACTORIES["shampoo"]
    for kw, word in [(dict(staleness=-1, async_precondition=True), "got -1"),
                     (dict(staleness=1.5, async_precondition=True), "got 1.5"),
                     (dict(staleness=2), "needs async_precondition=True"),
                     (dict(staleness=3, async_precondition=True, precondition_frequency=2),
                      "staleness=3 must be <= precondition_frequency=2"),
                     (dict(async_workers=0, async_precondition=True), "async_workers"),
                     (dict(async_precondition=1), "async_precondition")]:
        with pytest.raises(ValueError, match=re.escape(word)):
            groups(m, **kw)
    with pytest.raises(ValueError, match="staleness=4 must be"):
        SOAP([torch.nn.Parameter(torch.randn(4, 4))], precondition_frequency=3,
             async_precondition=True, staleness=4)


def test_exit_is_not_held_by_a_running_job():
    code = (
        "import torch, sys, time\n"
        "sys.path.insert(0, %r)\n"
        "from veragged.optim import Shampoo\n"
        "p = torch.nn.Parameter(torch.randn(8, 8))\n"
        "opt = Shampoo([p], precondition_frequency=1, start_preconditioning_step=1,\n"
        "              async_precondition=True, staleness=1)\n"
        "opt._roots.delay[0] = 600.0\n"
        "p.grad = torch.randn(8, 8)\n"
        "opt.step()\n"
        "assert opt._roots.in_flight()\n"
        "print('stepped', flush=True)\n"
    ) % os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # The job sleeps 600 s; a held exit would take that long. The bound is half of it, so a
    # loaded CI machine (import ~3-15 s) never trips it and a held exit always does.
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    elapsed = time.perf_counter() - start
    assert out.returncode == 0 and "stepped" in out.stdout, out.stderr
    assert elapsed < 300, elapsed


# ---- 4 gloo ranks ------------------------------------------------------------------------------


def _distributed(name, kind, f, k, steps, pattern, delay):
    m = model(kind, get_mesh())
    opt = _make(name, m, f, k, grad_agreement="mesh")  # gradients dropped by hand
    if delay:
        opt._roots.delay[0] = delay
    ref_model = model("single", None)
    ref = _make(name, ref_model, f, k, reference=True)
    params, ref_params = list(m.parameters()), list(ref_model.parameters())
    step_with_reference(opt, ref, params, ref_params, steps, pattern)
    equal = [torch.equal(a, b) for a, b in zip(full_values(params), ref_params)]
    return equal, opt.async_stats


@pytest.mark.parametrize("name,kind,f,k,delay", [
    ("shampoo", "veragged", 1, 1, 0.01),
    ("shampoo", "veragged", 3, 1, 0.0),
    ("shampoo", "veragged", 3, 2, 0.01),
    ("shampoo", "torch", 3, 3, 0.0),
    ("soap", "veragged", 3, 1, 0.01),
    ("soap", "torch", 3, 3, 0.0),
])
def test_distributed_async_equals_one_process_reference(name, kind, f, k, delay):
    """4 ranks, rank-asymmetric grad=None (some steps: no gradient anywhere for a parameter,
    whose counter and install wait with it), background jobs (some slowed), against the
    one-process reference that holds each refresh k steps."""
    results = run_on_ranks(_distributed, 4, args=(name, kind, f, k, 12, "cycle", delay),
                           timeout=240)
    for equal, _ in results:
        assert all(equal), equal
    assert sum(stats["installed"] for _, stats in results) > 0
    assert {stats["max_age"] for _, stats in results} <= {0, k}


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_training_with_background_refreshes_equals_one_process(name):
    """The user's path: real forward and backward on 4 ranks under veragged's and torch's
    fully_shard, refreshes in the background installed a step late; each run's parameters
    equal one process stepping on its gradients with the same staleness, bitwise."""
    from test_shampoo_soap import _train

    for kind in ("veragged", "torch"):
        equal, _ = run_on_ranks(_train, 4, args=(name, kind, 8),
                                kwargs=dict(async_precondition=True, staleness=1),
                                timeout=240)[0]
        assert all(equal), (kind, equal)


def _failing_job(name):
    """Rank 2's jobs raise; every rank must raise the same error at the same step, before its
    parameters change."""
    import veragged.optim.kronecker as kronecker
    import veragged.optim.shampoo as shampoo_mod

    import veragged.optim.soap as soap_mod

    module, attr = (shampoo_mod, "inverse_root_into") if name == "shampoo" else (
        soap_mod, "refresh_eigenbasis_into")
    real = getattr(module, attr)
    assert real is getattr(kronecker, attr)

    def boom(*args, **kwargs):
        raise ValueError("injected failure")

    m = model("veragged", get_mesh())
    opt = _make(name, m, 3, 1)
    if torch.distributed.get_rank() == 2:
        setattr(module, attr, boom)
    try:
        params = list(m.parameters())
        for step in range(10):
            set_grads(params, step)
            before = full_values(params)
            start = time.perf_counter()
            try:
                opt.step()
            except RuntimeError as e:
                unchanged = all(torch.equal(a, b) for a, b in zip(before, full_values(params)))
                elapsed = time.perf_counter() - start
                return step, str(e).split(" raised on ")[0], unchanged, elapsed
        return None
    finally:
        setattr(module, attr, real)  # the pool's process runs other tests next


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_a_failing_job_raises_on_every_rank(name):
    results = run_on_ranks(_failing_job, 4, args=(name,), timeout=120)
    assert all(r is not None for r in results), results
    assert len({(step, message) for step, message, _, _ in results}) == 1, results
    step, message, _, _ = results[0]
    assert "tile" in message and "submitted at its step" in message, message
    assert all(unchanged and elapsed < 30 for _, _, unchanged, elapsed in results), results


def _checkpoint_run(name, path, save, resume_steps, delay):
    m = model("veragged", get_mesh())
    opt = _make(name, m, 3, 2, grad_agreement="mesh")
    params = list(m.parameters())

    def step(i):
        set_grads(params, i, lambda j, r: (i + j) % 4 != 0)
        opt.step()

    if save:
        opt._roots.delay[0] = delay  # the jobs of counter 3 are in flight at the save
        for i in range(5):
            step(i)
        in_flight = bool(opt._roots.in_flight())
        save_checkpoint(m, opt, path)
    else:
        load_checkpoint(m, opt, path)
        in_flight = None
    for i in range(5, 5 + resume_steps):
        step(i)
    return full_values(params), in_flight, opt.async_stats


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_checkpoint_with_refreshes_in_flight_resumes_bitwise(name, tmp_path):
    """Saved on 4 ranks while jobs run; resumed on 4, on 2 (another owner plan) and on a 2x2
    HSDP mesh: each continuation equals the uninterrupted run, bitwise."""
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(_checkpoint_run, 4, args=(name, path, True, 6, 0.05), timeout=240)
    uninterrupted = saved[0][0]
    assert any(r[1] for r in saved)  # some rank had jobs in flight when it saved
    for world, kw in [(4, {}), (2, {}),
                      (4, dict(mesh_shape=(2, 2), mesh_dim_names=("replicate", "shard")))]:
        resumed = run_on_ranks(_checkpoint_run, world, args=(name, path, False, 6, 0.0),
                               timeout=240, **kw)
        for values, _, stats in resumed:
            assert all(torch.equal(a, b) for a, b in zip(uninterrupted, values)), (world, kw)
        assert sum(stats["installed"] for _, _, stats in resumed) > 0
