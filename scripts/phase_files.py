"""Which of veragged's Python files each phase of a training step runs through.

Two gloo ranks build the example Llama (2 blocks), shard it with `veragged.fully_shard` (every
block, then the root) and train it: the first iteration initialises (lazy init, optimizer
states), the second is recorded. A profile hook (`sys.setprofile`) notes the file of every
Python function called under `veragged/` (the example models in `veragged/models/` aside: they
are the user's code here) in each phase:

  setup     the fully_shard calls;
  forward   `model.loss(batch)`;
  backward  `loss.backward()`;
  clip      `torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`;
  adamw     `torch.optim.AdamW.step()` and `zero_grad()`;
  muon      `veragged.optim.Muon.step()` and `zero_grad()` (its own run: matrices with Muon,
            the rest with AdamW, as examples/train_llama.py groups them).

The per-phase lists are what a reader walks through to follow that phase. `--write` puts them
into docs/architecture.md between its `phase-files` markers; `--check` exits 1 when that block
is not what this run gives (tests/test_phase_files.py runs it, so the list stays true);
`--functions` prints which functions brought each file into each phase.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- phase-files:begin -->", "<!-- phase-files:end -->"
PHASES = ("setup", "forward", "backward", "clip", "adamw", "muon")
# The phases a plain training step runs (the union is the "step" line).
STEP = ("setup", "forward", "backward", "clip", "adamw")
# The example models are the user's code here, not the library's.
EXCLUDED = ("models/",)


class FileRecorder:
    """`sys.setprofile` hook: the veragged files whose functions are called, per phase."""

    def __init__(self):
        import veragged

        self.package = str(pathlib.Path(veragged.__file__).resolve().parent) + "/"
        self.phase: str | None = None
        self.files: dict[str, set[str]] = {p: set() for p in PHASES}
        # phase -> {(file, function)}: which functions brought each file in (`--functions`)
        self.functions: dict[str, set[tuple[str, str]]] = {p: set() for p in PHASES}
        self._seen: dict[object, str | None] = {}  # code object -> relative path or None

    def __call__(self, frame, event, arg):
        if event != "call" or self.phase is None:
            return
        code = frame.f_code
        rel = self._seen.get(code, False)
        if rel is False:
            name = code.co_filename
            rel = name[len(self.package):] if name.startswith(self.package) else None
            if rel is not None and rel.startswith(EXCLUDED):
                rel = None
            self._seen[code] = rel
        if rel is not None:
            self.files[self.phase].add(rel)
            self.functions[self.phase].add((rel, code.co_qualname))

    def run(self, phase: str, fn):
        self.phase = phase
        sys.setprofile(self)
        try:
            return fn()
        finally:
            sys.setprofile(None)
            self.phase = None


def _job(optimizer: str) -> dict[str, list[str]]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import veragged
    from veragged.models.llama import Llama, LlamaConfig, muon_param_groups

    rec = FileRecorder()
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Llama(LlamaConfig(vocab=64, dim=32, layers=2, heads=2, hidden=64, max_seq=16))

    def setup():
        for block in model.blocks:
            veragged.fully_shard(block, mesh=mesh)
        veragged.fully_shard(model, mesh=mesh)

    rec.run("setup", setup)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = veragged.optim.Muon(muon_param_groups(model), lr=0.02)
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, 64, (2, 17), generator=g)
    for step in range(2):
        record = step == 1
        run = rec.run if record else (lambda phase, fn: fn())
        loss = run("forward", lambda: model.loss(tokens))
        run("backward", loss.backward)
        if optimizer == "adamw":
            run("clip", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))

        def step_fn():
            opt.step()
            opt.zero_grad()

        run(optimizer, step_fn)
    keep = PHASES if optimizer == "adamw" else ("muon",)
    return {p: sorted(rec.functions[p]) for p in keep}


def measure_functions() -> dict[str, list[tuple[str, str]]]:
    """Each phase's (file, function) calls, the union over the ranks."""
    from tests.harness.pool import get_pool

    pool = get_pool(2, device="cpu")
    out: dict[str, set[tuple[str, str]]] = {p: set() for p in PHASES}
    for optimizer in ("adamw", "muon"):
        for rank_calls in pool.run(_job, optimizer, timeout=300):
            for p, calls in rank_calls.items():
                out[p].update(map(tuple, calls))
    return {p: sorted(out[p]) for p in PHASES}


def measure() -> dict[str, list[str]]:
    """Each phase's files, the same on every rank (their union, to be safe)."""
    return {p: sorted({f for f, _ in calls}) for p, calls in measure_functions().items()}


def render(files: dict[str, list[str]]) -> str:
    """The block docs/architecture.md holds between its markers."""
    step = sorted(set().union(*(files[p] for p in STEP)))
    lines = [BEGIN, "",
             "| phase | files | which (under `veragged/`) |", "|---|---|---|"]
    for p in PHASES:
        lines.append(f"| {p} | {len(files[p])} | {', '.join(f'`{f}`' for f in files[p])} |")
    lines.append(f"| setup + forward + backward + clip + adamw | {len(step)} | |")
    lines += ["", END]
    return "\n".join(lines)


def _current_block(text: str) -> str | None:
    if BEGIN not in text or END not in text:
        return None
    return text[text.index(BEGIN):text.index(END) + len(END)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="update docs/architecture.md")
    mode.add_argument("--check", action="store_true",
                      help="exit 1 if docs/architecture.md's list is stale")
    mode.add_argument("--functions", action="store_true",
                      help="print, per phase and file, the functions called there")
    args = parser.parse_args(argv)
    if args.functions:
        for p, calls in measure_functions().items():
            print(f"## {p}")
            by_file: dict[str, list[str]] = {}
            for f, fn in calls:
                by_file.setdefault(f, []).append(fn)
            for f, fns in by_file.items():
                print(f"  {f}: {', '.join(fns)}")
        return 0
    block = render(measure())
    text = DOC.read_text()
    current = _current_block(text)
    if args.write:
        if current is None:
            raise SystemExit(f"{DOC}: no {BEGIN} ... {END} markers to write between")
        DOC.write_text(text.replace(current, block))
        print(f"wrote {DOC.relative_to(ROOT)}")
    elif args.check:
        if current != block:
            print(f"{DOC.relative_to(ROOT)}: the per-phase file list is stale; run "
                  f"`python scripts/phase_files.py --write`. This run gives:\n{block}")
            return 1
        print("docs/architecture.md: per-phase file list is current")
    else:
        print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
