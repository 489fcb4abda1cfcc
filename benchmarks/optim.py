"""The optimizer benchmarks of issue 5, one after the other, in one run.

  (a) benchmarks/optim_muon.py       Muon step on 4 gloo ranks: owners vs replicated vs per-matrix
  (b) benchmarks/optim_owners.py     owner plan max/mean load, Qwen3 1.7B-32B at DP 16-128
  (c) benchmarks/optim_adamw8bit.py  AdamW8bit state bytes per parameter and step time vs torch

Each prints its table; at the end one JSON line holds the three JSON objects. `--quick` passes
`--quick` to (a) and (c).
"""

import argparse
import json
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
PARTS = {"muon": "optim_muon.py", "owners": "optim_owners.py", "adamw8bit": "optim_adamw8bit.py"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=sorted(PARTS), action="append")
    args = parser.parse_args(argv)
    results = {}
    for name, script in PARTS.items():
        if args.only and name not in args.only:
            continue
        cmd = [sys.executable, str(HERE / script)]
        if args.quick and name != "owners":
            cmd.append("--quick")
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        lines = out.strip().splitlines()
        print(f"== ({name}) {script}")
        print("\n".join(lines[:-1]))
        results[name] = json.loads(lines[-1])
    print(json.dumps({"benchmark": "optim", **results}))


if __name__ == "__main__":
    main()
