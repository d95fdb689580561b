// specdec's CPU kernels as one extension module (specdec.engine.cpu_kernels builds these files together, each its own
// translation unit, so a fresh host compiles them in parallel): this file, the one that includes torch's Python
// bindings, exports every kernel's functions; the kernels include ATen only (a third of the compile time).
//
//   skinny_gemm.cpp    every linear: float32 panels and a GGUF's blocks (skinny_linear, quant_linear)
//   row_attention.cpp  each new token's attention over its own slot (row_attention, store_rows)
//   row_ops.cpp        a Llama layer's small operators (add_rms_norm, rotary_, silu_mul)
//   decoder.cpp        the Llama decoder's layers in one call over the three (Decoder)

#include <torch/extension.h>

#include "decoder.h"
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_pack", &skinny_pack, "pack W [N, K] float32 for skinny_linear");
  m.def("skinny_linear", &skinny_linear, "y = x W^T + b in float32, batch-invariant (AVX-512 or AVX2)");
  m.def("quant_linear", &quant_linear, "y = x W^T + b, W in GGUF blocks dequantised in the product (AVX-512 or AVX2)");
  m.def("quant_dequant", &quant_dequant, "packed GGUF tiles -> float32 panels");
  m.def("quant_rows", &quant_rows, "rows of packed GGUF tiles dequantised (an embedding lookup)");
  m.def("row_attention", &row_attention, "attention of each query row over its own slot (float32, AVX-512 or AVX2)");
  m.def("store_rows", &store_rows, "a step's new keys and values into their slots (float32)");
  m.def("add_rms_norm", &add_rms_norm, "x += delta; RMSNorm(x) * weight, row by row (float32, AVX-512 or AVX2)");
  m.def("rotary_", &rotary_, "rotary embedding in place on each head of each row (float32, AVX-512 or AVX2)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up, row by row (float32, AVX-512 or AVX2)");
  pybind11::class_<Decoder>(m, "Decoder", "a Llama decoder's layers on specdec's kernels (float32, AVX-512 or AVX2)")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, at::Tensor, double>())
      .def("add_layer", &Decoder::add_layer, "append a layer's norms and packed products")
      .def("forward", &Decoder::forward, "the layers over a row-attention step, then the final norm",
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_tapped", &Decoder::forward_tapped, "forward, with the outputs of the layers in taps copied out",
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("num_layers", &Decoder::num_layers);
}
