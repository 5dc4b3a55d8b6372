// The specialization constants a header of this folder reads when it is opened alone (clangd, an editor):
// the served default (qk4pv8, head_dim 128, page_size 16, the op module's tile sizes, every knob at its
// default). A build always comes through templates/prefill.cu.jinja, which defines the constants and
// MPFA_PREFILL_SPECIALIZATION before any of these headers, so this file is then not read.
#pragma once
#include "mpfa/cache_layout.cuh"

namespace {

constexpr mpfa::Recipe kRecipe = mpfa::Recipe::kQk4pv8;
constexpr int kHeadDim = 128;
constexpr int kPageSize = 16;
using Layout = mpfa::CacheLayout<kRecipe, kHeadDim>;
constexpr int kBM = 128;
constexpr int kQScaleRows = 128;
constexpr int kBN = 128;
constexpr int kMuRows = 128;
constexpr float kLog2P = 8.807354922057604f;
constexpr bool kFacVec = 1;
constexpr int kStages = 3;
constexpr bool kPingPong = 1;
constexpr int kPolyEvery = 0;
constexpr bool kPersistent = 0;
constexpr bool kTileScale = 0;
constexpr bool kCompMma = 0;
constexpr bool kPvOnce = 0;
constexpr float kCompScaleDivisor = 499435.0625f;

}  // namespace
