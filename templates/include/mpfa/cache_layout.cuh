// The paged KV cache's byte layout per recipe, as every kernel (append, decode, prefill) reads and
// writes it. The definition is the Field table of python/mpfa/recipes/recipe.py: each kernel template
// renders that table's row widths into static_asserts against CacheLayout (templates/
// cache_layout_check.jinja), so a kernel built against a different layout does not compile.
//
// Every per-token field is [num_pages, num_kv_heads, page_size, row] ("HND" pages: one page of one
// head is one contiguous run); slot s is token s % page_size of page s / page_size.
#pragma once

namespace mpfa {

enum class Recipe : int { kBf16 = 0, kQk8pv8 = 1, kQk4pv8 = 2 };

// What a recipe stores, independent of head_dim.
template <Recipe R>
struct RecipeTraits {
  static constexpr Recipe kRecipe = R;
  // K smoothed by the layer's fixed mu_K and quantized with one FP32 scale per (token, head).
  static constexpr bool kQuantK = R != Recipe::kBf16;
  // V in E4M3 with fixed per-(layer, head, channel) scales applied after the PV product.
  static constexpr bool kQuantV = R != Recipe::kBf16;
  // The whole K row in one field (INT8 for qk8pv8, bf16 otherwise).
  static constexpr bool kWholeK = R != Recipe::kQk4pv8;
  // K split by frequency (recipes/int8.py quantize_i4rs): the low-frequency RoPE half of the channels as
  // INT8 (field k8), the other half as INT4 nibbles (field k) with one integer scale 1..18 per 16 channels.
  static constexpr bool kSplitK = R == Recipe::kQk4pv8;
};

// Bytes per (token, head) row of each field; 0 where the recipe has no such field.
template <Recipe R, int HeadDim>
struct CacheLayout : RecipeTraits<R> {
  using Traits = RecipeTraits<R>;
  static constexpr int kHeadDim = HeadDim;
  // "k": bf16 / INT8 values of the whole row, or qk4pv8's packed INT4 nibbles of the high-frequency half.
  static constexpr int k_bytes = R == Recipe::kBf16 ? 2 * HeadDim : (R == Recipe::kQk8pv8 ? HeadDim : HeadDim / 4);
  // "k8": qk4pv8's INT8 bytes of the low-frequency half.
  static constexpr int k8_bytes = Traits::kSplitK ? HeadDim / 2 : 0;
  // "k_block_scale": qk4pv8's integer block scales (1..18), one per 16 nibble channels, padded to 4 bytes so every
  // row is at least one 4-byte copy (head_dim 64 has 2 scales and 2 bytes of zeros).
  static constexpr int k_block_scale_bytes = Traits::kSplitK ? (HeadDim / 32 > 4 ? HeadDim / 32 : 4) : 0;
  // "k_scale": one FP32 scale per (token, head).
  static constexpr int k_scale_bytes = Traits::kQuantK ? 4 : 0;
  // "v": bf16 or E4M3 values, token-major like K (the prefill's pre-pass transposes V tiles for its MMA).
  static constexpr int v_bytes = Traits::kQuantV ? HeadDim : 2 * HeadDim;
  // What one token of one KV head stores in all: recipe.bytes_per_token_head(head_dim).
  static constexpr int kRowBytes = k_bytes + k8_bytes + k_block_scale_bytes + k_scale_bytes + v_bytes;
};

}  // namespace mpfa
