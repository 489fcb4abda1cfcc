// CUDA kernels of the block-scaled tile ops; see ../tiles.h and [Note: block-scaled rules] in
// ../rules.h (the same inline rules as the CPU kernels, so both round identically). One warp per
// tile, grid-stride over the tiles, on the current stream, no host synchronisation: the warp
// reduces the tile's amax (NaN-propagating max, order-independent), lane 0 writes the scale,
// and the warp writes the data.

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "quant/rules.h"
#include "quant/tiles.h"

namespace veragged {
namespace quant {
namespace {

constexpr int kWarps = 8;  // warps per block
constexpr int kThreads = kWarps * 32;

// Where one warp's tile is: its table row `t`, its index `k` in that row, its element range.
struct WarpTile {
  const int64_t* t;
  int64_t k;
  TileBox b;
  int64_t width, n;  // columns of the box, elements of the box
};

__device__ __forceinline__ WarpTile locate(const int64_t* table, int64_t n_rows, int64_t tile) {
  const int64_t* t = table + table_row(table, n_rows, tile) * kTableCols;
  const int64_t k = tile - t[kFirstTile];
  const TileBox b = tile_box(t, k);
  return {t, k, b, b.c1 - b.c0, (b.r1 - b.r0) * (b.c1 - b.c0)};
}

// Runs `body(tile, lane)` for every tile of the table, one warp per tile, grid-stride.
template <typename Body>
__device__ __forceinline__ void for_each_warp_tile(const int64_t* table, int64_t n_rows,
                                                   int64_t tiles, Body body) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  const int64_t n_warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t tile = warp; tile < tiles; tile += n_warps) body(locate(table, n_rows, tile), lane);
}

template <typename src_t, typename param_t>
__global__ void quantize_kernel(uint8_t* packed, const src_t* src, const int64_t* table,
                                int64_t n_rows, int64_t tiles) {
  for_each_warp_tile(table, n_rows, tiles, [&](const WarpTile& wt, int lane) {
    const int64_t* t = wt.t;
    const int64_t k = wt.k, f = t[kFormat], w = wt.width, n = wt.n, cols = t[kCols];
    const TileBox b = wt.b;
    const src_t* in = src + t[kElemOff];
    if (f == kRaw) {
      param_t* out = reinterpret_cast<param_t*>(packed + t[kDataOff]);
      for (int64_t c = b.c0 + lane; c < b.c1; c += 32) out[c] = static_cast<param_t>(in[c]);
      return;
    }
    float amax = 0.0f;
    for (int64_t i = lane; i < n; i += 32) {
      const int64_t r = b.r0 + i / w, c = b.c0 + i % w;
      amax = abs_max(amax, static_cast<float>(static_cast<param_t>(in[r * cols + c])));
    }
    for (int offset = 16; offset > 0; offset >>= 1)
      amax = combine_max(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    const TileScale s = tile_scale(f, amax);
    if (lane == 0) store_scale(f, packed + t[kScaleOff] + k * tile_scale_bytes(f), s.stored);
    uint8_t* data = packed + t[kDataOff];
    for (int64_t i = lane; i < n; i += 32) {
      const int64_t r = b.r0 + i / w, c = b.c0 + i % w;
      data[r * cols + c] =
          quantize_value(static_cast<float>(static_cast<param_t>(in[r * cols + c])), s.mul);
    }
  });
}

template <typename param_t>
__global__ void dequantize_kernel(param_t* dst, const uint8_t* packed, const int64_t* table,
                                  int64_t n_rows, int64_t tiles) {
  for_each_warp_tile(table, n_rows, tiles, [&](const WarpTile& wt, int lane) {
    const int64_t* t = wt.t;
    const int64_t k = wt.k, f = t[kFormat], w = wt.width, n = wt.n, cols = t[kCols];
    const TileBox b = wt.b;
    param_t* out = dst + t[kElemOff];
    if (f == kRaw) {
      const param_t* in = reinterpret_cast<const param_t*>(packed + t[kDataOff]);
      for (int64_t c = b.c0 + lane; c < b.c1; c += 32) out[c] = in[c];
      return;
    }
    const float inv = stored_scale_inv(f, packed + t[kScaleOff] + k * tile_scale_bytes(f));
    const uint8_t* data = packed + t[kDataOff];
    for (int64_t i = lane; i < n; i += 32) {
      const int64_t r = b.r0 + i / w, c = b.c0 + i % w;
      out[r * cols + c] = static_cast<param_t>(dequantize_value(data[r * cols + c], inv));
    }
  });
}

int grid_for(int64_t tiles) {
  const int64_t want = (tiles + kWarps - 1) / kWarps;
  const int cap = at::cuda::getCurrentDeviceProperties()->multiProcessorCount * 16;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, cap)));
}

}  // namespace

void quantize_tiles_cuda(at::Tensor& packed, const at::Tensor& src, const at::Tensor& table,
                         int64_t tiles, at::ScalarType param_dtype) {
  if (tiles == 0) return;
  const c10::cuda::CUDAGuard guard(src.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  VERAGGED_DISPATCH_QUANT(src.scalar_type(), "quantize_tiles_", [&] {
    using src_t = scalar_t;
    VERAGGED_DISPATCH_QUANT(param_dtype, "quantize_tiles_", [&] {
      quantize_kernel<src_t, scalar_t><<<grid_for(tiles), kThreads, 0, stream>>>(
          packed.data_ptr<uint8_t>(), src.data_ptr<src_t>(), table.data_ptr<int64_t>(),
          table.size(0), tiles);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequantize_tiles_cuda(at::Tensor& dst, const at::Tensor& packed, const at::Tensor& table,
                           int64_t tiles) {
  if (tiles == 0) return;
  const c10::cuda::CUDAGuard guard(dst.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  VERAGGED_DISPATCH_QUANT(dst.scalar_type(), "dequantize_tiles_", [&] {
    dequantize_kernel<scalar_t><<<grid_for(tiles), kThreads, 0, stream>>>(
        dst.data_ptr<scalar_t>(), packed.data_ptr<uint8_t>(), table.data_ptr<int64_t>(),
        table.size(0), tiles);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace quant
}  // namespace veragged
