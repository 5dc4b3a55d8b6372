// The specialization constants a header of this folder reads when it is opened alone (clangd, an editor):
// the served qk4pv8 build at head_dim 128, page_size 16 (mpfa_jit/ops/prefill.py SERVED_KNOBS, as
// prefill.cu.jinja renders it), so what an editor shows is what runs. A build always comes through
// templates/prefill.cu.jinja, which defines the constants and MPFA_PREFILL_SPECIALIZATION before any of these
// headers, so this file is then not read.
#pragma once
#include "mpfa/cache_layout.cuh"

namespace {

constexpr mpfa::Recipe kRecipe = mpfa::Recipe::kQk4pv8;
constexpr int kHeadDim = 128;
constexpr int kPageSize = 16;
using Layout = mpfa::CacheLayout<kRecipe, kHeadDim>;
constexpr int kBM = 192;
constexpr int kQScaleRows = 64;
constexpr int kBN = 128;
constexpr int kMuRows = 128;
constexpr float kLog2P = 8.0f;
constexpr int kStages = 2;
constexpr bool kTileScale = 1;
constexpr bool kCompMma = 1;
constexpr bool kPvOnce = 1;
constexpr float kCompScaleDivisor = 499435.0625f;

}  // namespace
