"""Kronecker-factor math shared by Shampoo and SOAP: factor updates, eigenbases, inverse roots.

Every function works on whole matrices on one rank (the owner: [Note: matrix optimizer
engine]); the distributed optimizers call exactly these, so they match one process bitwise.
A side that is not preconditioned is passed as None and acts as the identity.
"""

from __future__ import annotations

import torch

__all__ = [
    "eigenbasis",
    "inverse_root",
    "inverse_root_into",
    "project",
    "project_back",
    "refresh_eigenbasis",
    "refresh_eigenbasis_into",
    "tiles",
]


def project(g: torch.Tensor, q_left, q_right) -> torch.Tensor:
    """Q_L^T G Q_R: `g` in the eigenbasis (a None side is the identity)."""
    if q_left is not None:
        g = q_left.T @ g
    if q_right is not None:
        g = g @ q_right
    return g


def project_back(g: torch.Tensor, q_left, q_right) -> torch.Tensor:
    """Q_L G Q_R^T: `g` from the eigenbasis back to the parameter's coordinates."""
    if q_left is not None:
        g = q_left @ g
    if q_right is not None:
        g = g @ q_right.T
    return g


def eigenbasis(factor: torch.Tensor) -> torch.Tensor:
    """The eigenvectors of the symmetric `factor`, by descending eigenvalue (SOAP's initial
    basis: eigh of factor + 1e-30 I, in float64 if float32 fails)."""
    eye = torch.eye(factor.shape[0], dtype=factor.dtype, device=factor.device)
    try:
        _, q = torch.linalg.eigh(factor + 1e-30 * eye)
    except RuntimeError:  # failed to converge: retry in double precision
        _, q = torch.linalg.eigh(factor.double() + 1e-30 * eye.double())
        q = q.to(factor.dtype)
    return torch.flip(q, [1])


def refresh_eigenbasis(factor: torch.Tensor, q: torch.Tensor):
    """SOAP's refresh: one power iteration from the current basis `q`, then QR. Returns the new
    basis and the column order (by the estimated eigenvalues diag(Q^T F Q), descending) the
    second moment must be permuted by along this side."""
    estimated = torch.diag(q.T @ factor @ q)
    order = torch.argsort(estimated, descending=True, stable=True)
    basis, _ = torch.linalg.qr(factor @ q[:, order])
    return basis, order


def inverse_root(factor: torch.Tensor, root: int, epsilon: float) -> torch.Tensor:
    """(F + epsilon I)^(-1/root) of the symmetric positive semi-definite `factor` by a
    symmetric eigendecomposition in float64, returned in `factor`'s dtype. As Distributed
    Shampoo does, a negative smallest eigenvalue (round-off) shifts all of them up to 0 before
    epsilon is added, so the root is never NaN."""
    f = factor.double()
    values, vectors = torch.linalg.eigh(f)
    values = (values - values.min().clamp(max=0.0)).add(epsilon).pow(-1.0 / root)
    return ((vectors * values) @ vectors.T).to(factor.dtype)


def inverse_root_into(out: torch.Tensor, factor: torch.Tensor, root: int,
                      epsilon: float) -> None:
    """out <- `inverse_root(factor, root, epsilon)` bitwise, or NaN where the
    eigendecomposition fails, in one op (`veragged::inverse_root_`, csrc/optim/roots.cpp): a
    background job holds the GIL once for it ([Note: asynchronous roots])."""
    torch.ops.veragged.inverse_root_(out, factor, root, epsilon)


def refresh_eigenbasis_into(basis: torch.Tensor, order: torch.Tensor, factor: torch.Tensor,
                            q: torch.Tensor) -> None:
    """basis, order <- `refresh_eigenbasis(factor, q)` bitwise, in one op
    (`veragged::refresh_eigenbasis_`)."""
    torch.ops.veragged.refresh_eigenbasis_(basis, order, factor, q)


@torch.library.register_fake("veragged::inverse_root_")
def _inverse_root_fake(out, factor, root, epsilon):
    if root <= 0:
        raise ValueError(f"inverse_root_: root must be > 0, got {root}")
    if factor.ndim != 2 or factor.shape[0] != factor.shape[1]:
        raise ValueError(f"inverse_root_: factor must be a square matrix, got "
                         f"{list(factor.shape)}")
    if out.shape != factor.shape:
        raise ValueError(f"inverse_root_: out has shape {list(out.shape)} but factor has "
                         f"{list(factor.shape)}")


@torch.library.register_fake("veragged::refresh_eigenbasis_")
def _refresh_eigenbasis_fake(basis, order, factor, q):
    if factor.ndim != 2 or factor.shape != q.shape or basis.shape != q.shape:
        raise ValueError("refresh_eigenbasis_: factor, q and basis must be the same square "
                         f"matrix shape, got {list(factor.shape)}, {list(q.shape)} and "
                         f"{list(basis.shape)}")
    if order.ndim != 1 or order.shape[0] != q.shape[1] or order.dtype != torch.int64:
        raise ValueError(f"refresh_eigenbasis_: order must be int64 of length {q.shape[1]}")


def tiles(size: int, block: int) -> list[int]:
    """Tile sizes of a dimension of `size` cut every `block` elements (torch.split)."""
    return [min(block, size - s) for s in range(0, size, block)] if size else []
