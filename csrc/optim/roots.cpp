// `veragged::inverse_root_` and `veragged::refresh_eigenbasis_`: Shampoo's root and SOAP's basis
// refresh as one op each, so a background refresh job ([Note: asynchronous roots] in
// veragged/optim/async_roots.py) takes the GIL once per matrix side instead of once per ATen
// call. Each is the same ATen calls, in the same order and on the same layouts, as its Python
// twin in veragged/optim/kronecker.py (`inverse_root`, `refresh_eigenbasis`), so the results
// are bitwise the same (tests/optim/test_async_roots.py checks it); the synchronous path calls
// these ops too. Device-generic (CompositeExplicitAutograd): the ATen calls dispatch to CPU or
// CUDA kernels; the fake kernels are in veragged/optim/kernels.py.

#include <ATen/ATen.h>
#include <ATen/TensorIndexing.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <limits>

namespace veragged::optim {
namespace {

// out <- (factor + epsilon I)^(-1/root), eigenvalues shifted up to 0 first if the smallest is
// negative (round-off); NaN where the eigendecomposition fails to converge.
void inverse_root_(at::Tensor& out, const at::Tensor& factor, int64_t root, double epsilon) {
  TORCH_CHECK(root > 0, "inverse_root_: root must be > 0, got ", root);
  TORCH_CHECK(factor.dim() == 2 && factor.size(0) == factor.size(1),
              "inverse_root_: factor must be a square matrix, got ", factor.sizes());
  TORCH_CHECK(out.sizes() == factor.sizes(), "inverse_root_: out has shape ", out.sizes(),
              " but factor has ", factor.sizes());
  try {
    const at::Tensor f = factor.to(at::kDouble);
    auto [values, vectors] = at::linalg_eigh(f);
    values = (values - values.min().clamp(c10::nullopt, 0.0)).add(epsilon).pow(-1.0 / root);
    out.copy_(at::matmul(vectors * values, vectors.t()).to(factor.scalar_type()));
  } catch (const c10::LinAlgError&) {
    out.fill_(std::numeric_limits<double>::quiet_NaN());
  }
}

// SOAP's refresh: the column order by the estimated eigenvalues diag(Q^T F Q), descending
// (stable), and the basis qr(F Q[:, order]).Q.
void refresh_eigenbasis_(at::Tensor& basis, at::Tensor& order, const at::Tensor& factor,
                         const at::Tensor& q) {
  TORCH_CHECK(factor.dim() == 2 && factor.sizes() == q.sizes() && basis.sizes() == q.sizes(),
              "refresh_eigenbasis_: factor, q and basis must be the same square matrix shape, "
              "got ", factor.sizes(), ", ", q.sizes(), " and ", basis.sizes());
  TORCH_CHECK(order.dim() == 1 && order.size(0) == q.size(1) && order.scalar_type() == at::kLong,
              "refresh_eigenbasis_: order must be int64 of length ", q.size(1));
  const at::Tensor estimated = at::diag(at::matmul(at::matmul(q.t(), factor), q));
  const at::Tensor sorted = at::argsort(estimated, /*stable=*/true, /*dim=*/-1,
                                        /*descending=*/true);
  const at::Tensor permuted = q.index({at::indexing::Slice(), sorted});
  basis.copy_(std::get<0>(at::linalg_qr(at::matmul(factor, permuted))));
  order.copy_(sorted);
}

}  // namespace

TORCH_LIBRARY_IMPL(veragged, CompositeExplicitAutograd, m) {
  m.impl("inverse_root_", &inverse_root_);
  m.impl("refresh_eigenbasis_", &refresh_eigenbasis_);
}

}  // namespace veragged::optim
