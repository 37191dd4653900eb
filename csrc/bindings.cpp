// The Python module of the CPU kernels: every function the wrappers in tokenmill/kernels call. Built once
// per instruction-set variant (setup.py; TORCH_EXTENSION_NAME is the variant's module name), or from these
// sources at run time where no prebuilt variant fits (tokenmill/kernels/__init__.py). Errors raised with
// TORCH_CHECK reach Python as RuntimeError with their message (torch::wrap_pybind_function).
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include "block_quant.h"
#include "decode_step.h"
#include "fp8_matmul.h"
#include "fused_ops.h"
#include "lora.h"
#include "paged_attention.h"
#include "prefill_attention.h"

#define TM_DEF(name) m.def(#name, torch::wrap_pybind_function(name), #name)
#define TM_STRING(x) TM_STRING_(x)
#define TM_STRING_(x) #x

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  TM_DEF(block_quant_matmul);
  TM_DEF(block_quant_matmul_q8);
  TM_DEF(block_quant_dequantize);
  TM_DEF(block_quant_repack_panels);
  TM_DEF(block_quant_matmul_q8_panels);
  TM_DEF(block_quant_int8_peak);
  TM_DEF(add_rms_norm);
  TM_DEF(rotary_inplace);
  TM_DEF(silu_and_mul);
  TM_DEF(gelu_tanh_and_mul);
  TM_DEF(row_argmax);
  TM_DEF(paged_decode_attention);
  TM_DEF(paged_prefill_attention);
  TM_DEF(write_kv);
  TM_DEF(write_kv_quantized);
  TM_DEF(fp8_matmul);
  TM_DEF(fp8_dequantize);
  TM_DEF(lora_add);
  // module_local: each build registers its own class, so a stale prebuilt module imported first (to read its
  // sources_hash) does not stop the build from source from loading (pybind types are otherwise process-wide)
  pybind11::class_<DecodeStep, std::shared_ptr<DecodeStep>>(m, "DecodeStep", pybind11::module_local())
      .def(pybind11::init(torch::wrap_pybind_function(
          [](std::vector<torch::Tensor> tensors, std::vector<int64_t> ints, int64_t num_heads, int64_t num_kv_heads,
             int64_t head_dim, double eps, double scale, std::vector<double> soft_caps,
             std::vector<torch::Tensor> lora, std::vector<torch::Tensor> expert_tensors,
             std::vector<int64_t> expert_ints) {
            return std::make_shared<DecodeStep>(std::move(tensors), std::move(ints), num_heads, num_kv_heads, head_dim,
                                                eps, scale, std::move(soft_caps), std::move(lora),
                                                std::move(expert_tensors), std::move(expert_ints));
          })))
      .def("run", torch::wrap_pybind_function(&DecodeStep::run))
      .def_property_readonly("runs_chunks", &DecodeStep::runs_chunks);
  // Which sources it was built from (a digest given by the build): a stale prebuilt module is not loaded.
  m.attr("sources_hash") = TM_STRING(TM_SOURCES_HASH);
}
