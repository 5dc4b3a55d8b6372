// The specialization constants a header of this folder reads when it is opened alone (clangd, an editor):
// the served default (qk4pv8, head_dim 128, page_size 16, GQA group 4, the op module's 4 warps). A build
// always comes through templates/decode.cu.jinja, which defines the constants and MPFA_DECODE_SPECIALIZATION
// before any of these headers, so this file is then not read.
#pragma once
#include "mpfa/cache_layout.cuh"

namespace {

constexpr mpfa::Recipe kRecipe = mpfa::Recipe::kQk4pv8;
constexpr int kHeadDim = 128;
constexpr int kPageSize = 16;
constexpr int kGroup = 4;
constexpr int kWarps = 4;
using Layout = mpfa::CacheLayout<kRecipe, kHeadDim>;

}  // namespace
