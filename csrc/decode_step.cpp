#include "decode_step.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>

#include "block_quant.h"
#include "fused_ops.h"
#include "lora.h"
#include "paged_attention.h"

namespace decode_step {

// A linear layer: kind 0 dense (w [N, K]), 1 blocks with float activations, 2 blocks with int8
// activations (w: codes, then the rest of `block_quant.Blocks`, then the weight's panels where it has
// them: `block_quant.Panels`); absent tensors are empty. `lora`: its LoRA factors (a, b, shard_offsets),
// or null when the step runs no adapter.
struct Linear {
  torch::Tensor w, high, scales, offsets, supers, panel_codes, panel_scales, bias;
  int64_t kind, bits, center;
  const torch::Tensor* lora;
};

inline c10::optional<torch::Tensor> present(const torch::Tensor& t) {
  return t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// As the Python path: F.linear for dense weights; the block kernel, then `out += bias`; then the
// adapters' deltas (LoRAWeights.add_to).
// `segments`: the step's (seg_starts, seg_slots, seg_scales), or null.
torch::Tensor linear(const Linear& l, const torch::Tensor& x, const torch::Tensor* segments) {
  torch::Tensor out;
  if (l.kind == 0) {
    out = at::linear(x, l.w, present(l.bias));
  } else {
    out = torch::empty({x.size(0), l.w.size(0)}, x.options());
    const int64_t block = l.w.size(1) * (l.bits == 8 ? 1 : 2) / l.scales.size(1);
    if (l.kind == 2 && l.panel_codes.numel()) {  // as BlockQuantLinearMethod.apply
      const int64_t span = l.scales.scalar_type() == at::kChar && l.supers.numel() ? 256 : 32;  // activation_span
      block_quant_matmul_q8_panels(x, l.panel_codes, l.panel_scales, l.bits, span, out);
    } else {
      auto kernel = l.kind == 1 ? block_quant_matmul : block_quant_matmul_q8;
      kernel(x, l.w, present(l.high), l.scales, present(l.offsets), present(l.supers), l.bits, block, l.center, out);
    }
    if (l.bias.numel()) out += l.bias;
  }
  if (l.lora) lora_add(x.contiguous(), l.lora[0], l.lora[1], l.lora[2], segments[0], segments[1], segments[2], out);
  return out;
}

}  // namespace decode_step

// hidden: [T, hidden] (every token a decode); residual: the stream so far (absent before the first
// layer). Per layer, `tensors` holds input norm, post-attention norm, k cache, v cache, k scales, v
// scales (empty unless the cache is int8 / fp8), then
// (w, high, scales, offsets, supers, panel codes, panel scales, bias) of qkv, o, gate_up, down; `ints`
// holds (kind, bits, center) of those four.
// `lora`: empty, or per layer the LoRA factors (a, b, shard_offsets) of qkv, o, gate_up, down;
// `lora_segments`: empty, or the step's (seg_starts, seg_slots, seg_scales) (tokenmill/kernels/lora.py).
// Returns {hidden, residual} after the last layer (the final norm is the caller's).
std::vector<torch::Tensor> decode_layers(torch::Tensor hidden, c10::optional<torch::Tensor> residual,
                                         torch::Tensor positions, torch::Tensor slots, torch::Tensor block_tables,
                                         torch::Tensor context_lens, torch::Tensor cos_sin,
                                         std::vector<torch::Tensor> tensors, std::vector<int64_t> ints,
                                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                                         double scale, std::vector<torch::Tensor> lora,
                                         std::vector<torch::Tensor> lora_segments) {
  using decode_step::Linear;
  const int64_t T = hidden.size(0), H = num_heads, KVH = num_kv_heads, D = head_dim;
  constexpr size_t kTensors = 6 + 4 * 8, kInts = 4 * 3, kLoRA = 4 * 3;
  const size_t layers = tensors.size() / kTensors;
  TORCH_CHECK(lora.empty() || lora.size() == kLoRA * layers, "decode_layers: 12 LoRA tensors per layer, or none");
  TORCH_CHECK(lora_segments.empty() || lora_segments.size() == 3, "decode_layers: 3 LoRA segment tensors, or none");
  const torch::Tensor* segments = lora.empty() || lora_segments.empty() ? nullptr : lora_segments.data();
  torch::Tensor res = residual ? *residual : torch::Tensor();
  for (size_t i = 0; i < layers; ++i) {
    const torch::Tensor* t = tensors.data() + kTensors * i;
    const int64_t* k = ints.data() + kInts * i;
    auto make = [&](int j) {
      const torch::Tensor* l = t + 6 + 8 * j;
      const torch::Tensor* factors = segments ? lora.data() + kLoRA * i + 3 * j : nullptr;
      return Linear{l[0], l[1], l[2], l[3], l[4], l[5], l[6], l[7], k[3 * j], k[3 * j + 1], k[3 * j + 2], factors};
    };
    const Linear qkv_proj = make(0), o_proj = make(1), gate_up_proj = make(2), down_proj = make(3);

    auto normed = torch::empty_like(hidden);
    add_rms_norm(hidden, res.defined() ? c10::optional<torch::Tensor>(res) : c10::nullopt, t[0], eps, normed);
    res = hidden;
    auto qkv = decode_step::linear(qkv_proj, normed, segments).view({T, H + 2 * KVH, D});
    rotary_inplace(qkv.narrow(1, 0, H + KVH), positions, cos_sin);
    const bool quantized = t[4].numel() > 0;
    if (quantized)
      write_kv_quantized(qkv.narrow(1, H, KVH), qkv.narrow(1, H + KVH, KVH), t[2], t[3], t[4], t[5], slots);
    else
      write_kv(qkv.narrow(1, H, KVH), qkv.narrow(1, H + KVH, KVH), t[2], t[3], slots);
    auto attn = torch::empty({T, H, D}, hidden.options());
    paged_decode_attention(qkv.narrow(1, 0, H).contiguous(), t[2], t[3], block_tables, context_lens, scale, 0, 0.0,
                           attn, decode_step::present(t[4]), decode_step::present(t[5]));
    auto o = decode_step::linear(o_proj, attn.view({T, H * D}), segments);

    normed = torch::empty_like(o);
    add_rms_norm(o, res, t[1], eps, normed);
    res = o;
    auto gate_up = decode_step::linear(gate_up_proj, normed, segments);
    auto act = torch::empty({T, gate_up.size(1) / 2}, hidden.options());
    silu_and_mul(gate_up, act);
    hidden = decode_step::linear(down_proj, act, segments);
  }
  return {hidden, res};
}
