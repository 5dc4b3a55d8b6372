// The paged KV cache's byte layout per recipe, as every kernel (append, decode, prefill) reads and
// writes it. The row widths are not computed here: each kernel template renders them from the one
// definition, the Field table of mpfa_jit/formats.py (templates/cache_layout_check.jinja), as the
// arguments of CacheLayout; this header keeps the field names, their order and what each recipe stores.
//
// Every per-token field is [num_pages, num_kv_heads, page_size, row] ("HND" pages: one page of one
// head is one contiguous run); slot s is token s % page_size of page s / page_size.
#pragma once

namespace mpfa {

enum class Recipe : int { kBf16 = 0, kQk8pv8 = 1, kQk4pv8 = 2, kQk4pv4 = 3 };

// What a recipe stores, independent of head_dim.
template <Recipe R>
struct RecipeTraits {
  static constexpr Recipe kRecipe = R;
  // K smoothed by the layer's fixed mu_K and quantized with one FP32 scale per (token, head).
  static constexpr bool kQuantK = R != Recipe::kBf16;
  // V quantized: E4M3 with fixed per-(layer, head, channel) scales applied after the PV product, or kV4's codes.
  static constexpr bool kQuantV = R != Recipe::kBf16;
  // V as 4-bit codes of the Hadamard-rotated row V H (recipes/u4h.py), with an fp16 scale and zero point per 32
  // channels (field v_param): decode dequantizes them to fp16 and outputs O H (the wrapper rotates back); the
  // prefill's pre-pass turns them into the E4M3 image of the other quantized recipes, under v_scale of V H.
  static constexpr bool kV4 = R == Recipe::kQk4pv4;
  // K split by frequency (recipes/int8.py quantize_i4rs): the low-frequency RoPE half of the channels as
  // INT8 (field k8), the other half as INT4 nibbles (field k) with one integer scale 1..18 per 16 channels.
  static constexpr bool kSplitK = R == Recipe::kQk4pv8 || R == Recipe::kQk4pv4;
  // The whole K row in one field (INT8 for qk8pv8, bf16 for bf16).
  static constexpr bool kWholeK = !kSplitK;
};

// Bytes per (token, head) row of each field, in the Field table's names; 0 where the recipe has no such field.
//   k: bf16 / INT8 values of the whole row, or qk4pv8's packed INT4 nibbles of the high-frequency half;
//   k8: qk4pv8's INT8 bytes of the low-frequency half;
//   k_block_scale: qk4pv8's integer block scales (1..18), one per 16 nibble channels, at least 4 bytes so that
//     every row is one 4-byte copy or more;
//   k_scale: one FP32 scale per (token, head);
//   v: bf16 or E4M3 values, token-major like K (the prefill's pre-pass transposes V tiles for its MMA), or
//     kV4's 4-bit codes, two a byte (channel 2i in the low nibble of byte i);
//   v_param: kV4's fp16 [scale, zero] of each group of 32 channels (halves 2g, 2g + 1).
template <Recipe R, int HeadDim, int KBytes, int K8Bytes, int KBlockScaleBytes, int KScaleBytes, int VBytes,
          int VParamBytes>
struct CacheLayout : RecipeTraits<R> {
  using Traits = RecipeTraits<R>;
  static constexpr int kHeadDim = HeadDim;
  static constexpr int k_bytes = KBytes;
  static constexpr int k8_bytes = K8Bytes;
  static constexpr int k_block_scale_bytes = KBlockScaleBytes;
  static constexpr int k_scale_bytes = KScaleBytes;
  static constexpr int v_bytes = VBytes;
  static constexpr int v_param_bytes = VParamBytes;
  // kV4: channels per scale and zero point.
  static constexpr int kV4Group = 32;
  // What one token of one KV head stores in all: recipe.bytes_per_token_head(head_dim).
  static constexpr int kRowBytes = k_bytes + k8_bytes + k_block_scale_bytes + k_scale_bytes + v_bytes + v_param_bytes;
  // The kernels' reads assume these of a recipe's fields.
  static_assert(k_bytes > 0 && v_bytes > 0, "every recipe stores K and V");
  static_assert((k_scale_bytes == sizeof(float)) == Traits::kQuantK, "quantized K has one FP32 scale per row");
  static_assert((k8_bytes > 0) == Traits::kSplitK && (k_block_scale_bytes > 0) == Traits::kSplitK,
                "split K stores k8 and k_block_scale; no other recipe does");
  static_assert(v_bytes == (Traits::kV4 ? HeadDim / 2 : (Traits::kQuantV ? 1 : 2) * HeadDim),
                "V holds one E4M3 or bf16 value per channel, or kV4's 4-bit code");
  static_assert(v_param_bytes == (Traits::kV4 ? HeadDim / kV4Group * 2 * 2 : 0),
                "kV4 stores an fp16 scale and zero point per 32 channels; no other recipe has v_param");
};

}  // namespace mpfa
