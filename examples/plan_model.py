"""Plans the FSDP buffers of a small transformer with veragged's planner and prints them.

Each transformer block is one parameter group, as fully_shard wraps it. Linear weights keep
whole rows (block = in_features * --rows), everything else is element-wise.

    python examples/plan_model.py --world-size 8 --rows 16
"""

import argparse

import torch
from torch import nn

import veragged


def block(dim: int, hidden: int) -> nn.Module:
    return nn.ModuleDict(
        {
            "attn_norm": nn.LayerNorm(dim),
            "qkv": nn.Linear(dim, 3 * dim, bias=False),
            "out": nn.Linear(dim, dim, bias=False),
            "mlp_norm": nn.LayerNorm(dim),
            "up": nn.Linear(dim, hidden, bias=False),
            "down": nn.Linear(hidden, dim, bias=False),
        }
    )


def block_size(param: torch.Tensor, rows: int) -> int:
    if param.dim() == 2 and param.shape[0] % rows == 0:
        return rows * param.shape[1]
    return 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--rows", type=int, default=16, help="rows per block of linear weights")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()

    model = nn.ModuleList(block(args.dim, 4 * args.dim) for _ in range(args.layers))
    for i, layer in enumerate(model):
        names, params = zip(*layer.named_parameters())
        layout = veragged.plan(
            [p.numel() for p in params], [block_size(p, args.rows) for p in params], args.world_size
        )
        total = sum(p.numel() for p in params)
        print(
            f"block {i}: shard {layout.shard_size} elements/rank, padding {layout.padding} "
            f"({100 * layout.padding / total:.3f}%), order {layout.order}"
        )
        if i == 0:
            for name, (start, end), units in zip(names, layout.ranges, layout.units):
                print(f"  {name:16s} [{start:>9}, {end:>9})  blocks per rank {units}")


if __name__ == "__main__":
    main()
