// The one TORCH_LIBRARY(veragged, m): every schema of the extension, and the _C module.
//
// Schemas live here only. Ops with tensor arguments take their kernels from TORCH_LIBRARY_IMPL
// blocks beside each implementation (CPU: dbuffer/group_ops.cpp, CUDA: dbuffer/cuda/group_ops.cu;
// optim/adamw8bit.cpp, optim/cuda/adamw8bit.cu; quant/tiles.cpp, quant/cuda/tiles.cu;
// device-generic: optim/roots.cpp, dbuffer/memory.cpp) plus a fake
// kernel registered in Python (veragged/dbuffer/ops.py, veragged/optim/kernels.py,
// veragged/optim/kronecker.py); host-side ops with no tensor arguments bind their single kernel
// with the schema.

#include <Python.h>
#include <torch/library.h>

#include "bindings/ops.h"
#include "bindings/tensor_attrs.h"

extern "C" {
// `import veragged._C` loads this library, which runs the registrations below. The ops are
// reached through torch.ops.veragged; the module's own Python API is one descriptor type
// (bindings/tensor_attrs.cpp).
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module != nullptr && veragged::add_tensor_attrs(module) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
}

TORCH_LIBRARY(veragged, m) {
  // Host-side planning: plain ints in and out, no tensors, so one kernel serves every backend
  // and fake-tensor tracing alike (it never touches device memory).
  m.def(
      "plan_layout(int[] numels, int[] block_sizes, int world_size, int align) "
      "-> (int shard_size, int[] starts, int[] permutation, int order)",
      &veragged::plan_layout_op);
  // Host-side RaggedShard box and interval math (checkpointing, redistribution): same pattern.
  m.def("flat_range_boxes(int[] shape, int begin, int end) -> int[]",
        &veragged::flat_range_boxes_op);
  m.def(
      "interval_overlaps(int[] src_bounds, int[] dst_bounds, int rank) "
      "-> (int[] send, int[] recv)",
      &veragged::interval_overlaps_op);
  // A DBuffer's flat allocations: 256-byte aligned, exactly the bytes asked for
  // ([Note: aligned buffers]; kernel: dbuffer/memory.cpp, fake: veragged/dbuffer/ops.py).
  m.def("aligned_empty(int numel, ScalarType dtype, Device device, bool pin_memory=False) "
        "-> Tensor");
  // DBuffer group ops: one launch over a group's flat buffer ([Note: DBuffer group ops]).
  m.def("cast_scale_(Tensor(a!) dst, Tensor src, float alpha=1.0) -> ()");
  m.def("accumulate_(Tensor(a!) dst, Tensor src, float alpha=1.0) -> ()");
  m.def("zero_ranges_(Tensor(a!) dst, int[] ranges) -> ()");
  m.def("land_(Tensor(a!) dst, Tensor[] srcs, int[] pieces, float alpha=1.0) -> ()");
  // Host-side owner plan of distributed Muon, Shampoo and SOAP ([Note: matrix owner plan],
  // optim/owners.h): block b of the flattened row blocks belongs to the matrix its
  // blocks_per_matrix run covers; micro-group g is
  // group_members[group_offsets[g]:group_offsets[g + 1]]; capacity <= 0 asks for the default and
  // the capacity used comes back (0 unless strategy is "lpt" or "local"); held (elements per
  // matrix and rank, matrix-major, or empty) gives "local" its homes and every strategy its
  // moved elements (-1 without held). matrix_costs returns the per-matrix costs that the plan
  // balances.
  m.def(
      "plan_owners(int[] block_rows, int[] block_cols, int[] blocks_per_matrix, int[] buckets, "
      "int world_size, str strategy, str cost, float alpha, int capacity, int ns_steps, "
      "int precondition_frequency, int max_preconditioner_dim, int[] held, "
      "float locality_slack) -> (int[] owners, int[] group_offsets, int[] group_members, "
      "int[] loads, int capacity, int moved)",
      &veragged::plan_owners_op);
  m.def(
      "matrix_costs(int[] block_rows, int[] block_cols, int[] blocks_per_matrix, str cost, "
      "int ns_steps, int precondition_frequency, int max_preconditioner_dim) -> int[]",
      &veragged::matrix_costs_op);
  // Block-wise 8-bit AdamW: one fused step of a list of parameter shards of one dtype in one
  // launch, each with its own step count, in place on the parameters, the uint8 codes and the
  // per-block fp32 absmax of both moments ([Note: AdamW8bit kernel], [Note: AdamW8bit
  // multi-tensor launch]): AdamW8bit steps a param group's 8-bit parameters with one call.
  m.def(
      "adamw8bit_multi_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] m_codes, "
      "Tensor(c!)[] v_codes, Tensor(d!)[] m_absmax, Tensor(e!)[] v_absmax, Tensor qmap_signed, "
      "Tensor qmap_unsigned, float lr, float beta1, float beta2, float eps, float weight_decay, "
      "int[] steps, int block_size) -> ()");
  // Shampoo's inverse root and SOAP's basis refresh of one matrix side, each one op (one GIL
  // release for a background refresh job: optim/roots.cpp, [Note: asynchronous roots]).
  m.def("inverse_root_(Tensor(a!) out, Tensor factor, int root, float epsilon) -> ()");
  m.def("refresh_eigenbasis_(Tensor(a!) basis, Tensor(b!) order, Tensor factor, Tensor q) -> ()");
  // Block-scaled 8-bit weights ([Note: block-scaled weights]): the packed all-gather slot's
  // layout (host-side, quant/layout.h) and the tile kernels over a table of segments
  // (quant/tiles.h; CPU: quant/tiles.cpp, CUDA: quant/cuda/tiles.cu, fakes:
  // veragged/quant/ops.py).
  m.def("quant_layout(int[] specs, int shard_size, int world, int align) "
        "-> (int slot_bytes, int[] segments, int[] rank_bytes)",
        &veragged::quant_layout_op);
  m.def("check_tile_table(Tensor table, int numel, int bytes, int tiles, int raw_itemsize) -> ()");
  m.def("quantize_tiles_(Tensor(a!) packed, Tensor src, Tensor table, int tiles, "
        "ScalarType param_dtype) -> ()");
  m.def("dequantize_tiles_(Tensor(a!) dst, Tensor packed, Tensor table, int tiles) -> ()");
}
