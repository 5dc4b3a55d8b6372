// Global -> shared copies of one kTile-token tile of a request's pages (cp.async, one stage of the
// pipeline): every field's rows of one KV head, tile by tile. Full tiles take FullTileCopier (per-thread
// addressing computed once per CTA); a request's last tile takes load_partial_tile (bytes past the length
// zero-filled). Both read the tile's page ids from the kernel's page-id ring: ph = page_id * num_kv_heads
// + head, so the page's run of this head starts at field base + ph * page_size * row bytes.
#pragma once
#include <cstdint>
#include "mpfa/decode/params.cuh"
#include "mpfa/decode/traits.cuh"
#include "mpfa/mma_frag.cuh"

namespace {

// Copies one field of a request's last kTile-token tile into shared memory, zero-filling bytes past
// valid_tokens (full tiles take FullTileField below). R: bytes per row; unit U = 16 bytes, or a
// whole page's run when that is shorter (page size 1 with small rows: 4- or 8-byte copies).
// ph[pit] = page_id * num_kv_heads + head of the tile's pit-th page, so the page's run of this head
// starts at base + ph * page_size * R.
template <class Cfg, int R, bool kSwizzleK, bool kSwizzleV>
__device__ __forceinline__ void load_field(uint32_t dst_base, const uint8_t* base, const uint32_t* ph,
                                           int valid_tokens) {
  using T = DecodeTraits<Cfg>;
  constexpr int kRun = T::kPageSize * R;
  constexpr int U = kRun < 16 ? kRun : 16;
  constexpr int N = T::kTile * R / U;
#pragma unroll
  for (int i = 0; i < (N + T::kThreads - 1) / T::kThreads; ++i) {
    const int u = int(threadIdx.x) + i * T::kThreads;
    if (N % T::kThreads == 0 || u < N) {
      const int o = u * U;
      const int pit = o / kRun;
      const int within = o % kRun;
      int dst = o;
      if constexpr (R >= 16 && (kSwizzleK || kSwizzleV)) {
        const int row = o / R, chunk = (o % R) / 16;
        const int sw = kSwizzleK ? T::k_swizzle(row) : T::v_swizzle(row);
        // kV4's V swizzle moves whole rows within their 128-byte line, which only the XOR of the byte offset
        // expresses; the other recipes keep the chunk form (same addresses, the code their builds were
        // measured with)
        if constexpr (T::kV4) dst = o ^ (sw << 4);
        else dst = row * R + ((chunk ^ sw) << 4);
      }
      const uint8_t* src = base + within;
      int nbytes = valid_tokens * R - o;
      nbytes = nbytes < 0 ? 0 : (nbytes > U ? U : nbytes);
      if (nbytes > 0) src += uint64_t(ph[pit]) * kRun;
      mpfa::cp_async<U>(dst_base + dst, src, nbytes);
    }
  }
}

// The same copy for a tile wholly inside the sequence (every tile but a request's last), written for
// the issue cost per piece: thread t copies pieces o = t * U + i * kStep (kStep = kThreads x U
// bytes). Page runs and kStep are powers of two, so one divides the other and the piece's ring slot
// and offset within its page run follow from piece 0's by compile-time steps; the swizzles repeat
// every 2 (K) / 16 (V) rows, so (except bf16 d128 V) its shared destination does too. The per-thread
// parts (source pointer within a run, ring slot, destination) are computed once per CTA, and a piece
// costs one IMAD.WIDE (page id x run length + source) and the LDGSTS.
template <class Cfg, int R, bool kSwizzleK, bool kSwizzleV, bool kOpaqueBase, bool kSpread = false>
struct FullTileField {
  using T = DecodeTraits<Cfg>;
  static constexpr int kThreads = T::kThreads;
  static constexpr int kRun = T::kPageSize * R;
  static constexpr int U = kRun < 16 ? kRun : 16;
  static constexpr int N = T::kTile * R / U;
  static constexpr int kPieces = (N + kThreads - 1) / kThreads;
  static constexpr int kStep = kThreads * U;
  static_assert(kRun % kStep == 0 || kStep % kRun == 0, "page runs and kStep are powers of two");
  static constexpr bool kSwizzled = R >= 16 && (kSwizzleK || kSwizzleV);
  static constexpr bool kSwizzleRepeats = !kSwizzled || (kSwizzleK ? (kStep / R) % 2 == 0 : (kStep / R) % 16 == 0);

  const uint8_t* src0;   // field base + this thread's offset within a page run
  uint32_t slot0;        // ring slot (page of the tile) of piece 0
  uint32_t dst0;         // offset of piece 0 within the field's part of a stage
  uint32_t ph[kPieces];

  // kSpread (the scales at page size 1; FullTileScales at larger pages): piece t goes to lane t / 4
  // of warp t % 4, so every warp issues the same few copies. Packed into the first warps, those warps
  // would issue ~20 more instructions per tile than the others, all on one SM sub-partition (a CTA's
  // warp w runs on sub-partition w % 4).
  __device__ __forceinline__ static int vthread() {
    return kSpread ? int(threadIdx.x % 32) * T::kWarps + int(threadIdx.x / 32) : int(threadIdx.x);
  }
  __device__ __forceinline__ static bool active(int i) {
    return N % kThreads == 0 || vthread() + i * kThreads < N;
  }
  __device__ __forceinline__ static uint32_t dst_of(uint32_t o) {
    if constexpr (!kSwizzled) {
      return o;
    } else {
      const int row = int(o) / R, chunk = (int(o) % R) / 16;
      const int sw = kSwizzleK ? T::k_swizzle(row) : T::v_swizzle(row);
      if constexpr (T::kV4) return o ^ uint32_t(sw << 4);   // as load_field: kV4 moves rows within their line
      else return uint32_t(row * R + ((chunk ^ sw) << 4));
    }
  }
  __device__ __forceinline__ explicit FullTileField(const uint8_t* base) {
    const uint32_t o0 = uint32_t(vthread()) * U;
    if constexpr (kOpaqueBase) {
      // Opaque to the compiler, so the pointer is kept in two registers rather than rebuilt from the
      // kernel parameter at every piece (IMAD.WIDE + LOP3 + IADD3 + IADD3.X instead of one IMAD.WIDE).
      asm("add.s64 %0, %1, %2;\n" : "=l"(src0) : "l"(base), "l"(uint64_t(o0 % kRun)));
    } else {
      src0 = base + o0 % kRun;
    }
    // = o0 / kRun; a compile-time 0 when a run spans all threads' first pieces, so the ring reads
    // of such a field (V at page >= 16) are at fixed offsets and merge into one vector load.
    slot0 = kRun >= kStep ? 0u : uint32_t(vthread()) / (kRun / U);
    dst0 = dst_of(o0);
  }
  __device__ __forceinline__ void read_ids(const uint32_t* ring) {
#pragma unroll
    for (int i = 0; i < kPieces; ++i)
      if (active(i)) ph[i] = ring[slot0 + (i * kStep) / kRun];
  }
  __device__ __forceinline__ void issue(uint32_t dst_field) const {
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      if (active(i)) {
        const uint32_t dst = kSwizzleRepeats ? dst_field + dst0 + i * kStep
                                             : dst_field + dst_of(uint32_t(vthread()) * U + i * kStep);
        const int in_run = kRun > kStep ? (i * kStep) % kRun : 0;
        mpfa::cp_async_full<U>(dst, src0 + uint64_t(ph[i]) * kRun + in_run);
      }
    }
  }
};

// The block and token scales (and kV4's v_param) of a full tile as one set of 16-byte pieces (block-scale
// pieces, then token-scale pieces, then v_param pieces), at most one per thread, spread over the warps like
// FullTileField's kSpread: one ring read, one IMAD.WIDE and one LDGSTS per thread instead of two (three) of
// each. Its per-thread constants (source pointer, run length, ring slot, destination) live in shared memory,
// read back with one LDS.128 per tile: kept in registers, they spill qk4pv8 d128 at the 128-register cap.
template <class Cfg>
struct FullTileScales {
  using T = DecodeTraits<Cfg>;
  using Layout = typename T::Layout;
  static constexpr int kRunBs = T::kPageSize * Layout::k_block_scale_bytes;
  static constexpr int kRunKs = T::kPageSize * Layout::k_scale_bytes;
  static constexpr int kRunVp = T::kPageSize * Layout::v_param_bytes;
  static constexpr int kNBs = T::kTile * Layout::k_block_scale_bytes / 16, kNKs = T::kTile * Layout::k_scale_bytes / 16;
  static constexpr int kNVp = T::kTile * Layout::v_param_bytes / 16;
  static_assert(kNBs + kNKs + kNVp <= T::kThreads, "one piece per thread");
  uint4 d;       // {source lo, source hi, run length, ring slot << 16 | stage offset}
  uint32_t ph;

  __device__ __forceinline__ static int vthread() { return int(threadIdx.x % 32) * T::kWarps + int(threadIdx.x / 32); }
  __device__ __forceinline__ static bool active() { return vthread() < kNBs + kNKs + kNVp; }
  __device__ __forceinline__ static uint4* desc(uint8_t* smem) {
    return reinterpret_cast<uint4*>(smem + T::kOffDesc) + threadIdx.x;
  }
  // Once per CTA, before any copy (each thread reads back only its own descriptor).
  __device__ __forceinline__ static void init(uint8_t* smem, const DecodeParams& p) {
    if constexpr (T::kMergedScales) {
      const int v = vthread();
      const bool is_bs = v < kNBs, is_ks = !is_bs && (kNVp == 0 || v < kNBs + kNKs);
      const uint32_t o0 = uint32_t(is_bs ? v : is_ks ? v - kNBs : v - kNBs - kNKs) * 16;
      const uint32_t run = is_bs ? kRunBs : is_ks ? kRunKs : kRunVp;
      const uint8_t* base = is_bs ? p.k_block_scale : is_ks ? p.k_scale : p.v_param;
      const uint32_t stage_off = is_bs ? T::kOffBs : is_ks ? T::kOffKs : T::kOffVp;
      const uint64_t src = reinterpret_cast<uint64_t>(base + o0 % run);
      *desc(smem) = make_uint4(uint32_t(src), uint32_t(src >> 32), run, (o0 / run) << 16 | (stage_off + o0));
    }
  }
  __device__ __forceinline__ void read_ids(uint8_t* smem, const uint32_t* ring) {
    d = *desc(smem);
    if (active()) ph = ring[d.w >> 16];
  }
  __device__ __forceinline__ void issue(uint32_t st) const {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(uint64_t(d.y) << 32 | d.x);
    if (active()) mpfa::cp_async_full<16>(st + (d.w & 0xFFFFu), src + uint64_t(ph) * d.z);
  }
};

// A field's row bytes as a copier's template argument: 4 where the recipe has no such field (its copier
// is built but never issues).
constexpr int row_or_placeholder(int bytes) { return bytes > 0 ? bytes : 4; }

// Every field's copier, built once per CTA. k8's base is rebuilt per piece (not opaque): registers.
// bs, ks and vp are used at page size 1 only (FullTileScales otherwise).
template <class Cfg>
struct FullTileCopier {
  using T = DecodeTraits<Cfg>;
  using Layout = typename T::Layout;
  FullTileField<Cfg, Layout::k_bytes, true, false, true> k;
  FullTileField<Cfg, row_or_placeholder(Layout::k8_bytes), false, false, false> k8;
  FullTileField<Cfg, row_or_placeholder(Layout::k_block_scale_bytes), false, false, false, true> bs;
  FullTileField<Cfg, row_or_placeholder(Layout::k_scale_bytes), false, false, false, true> ks;
  FullTileField<Cfg, Layout::v_bytes, false, true, true> v;
  FullTileField<Cfg, row_or_placeholder(Layout::v_param_bytes), false, false, false, true> vp;
  FullTileScales<Cfg> scales;
  uint8_t* smem;
  __device__ __forceinline__ FullTileCopier(const DecodeParams& p, uint8_t* smem_)
      : k(p.k), k8(p.k8), bs(p.k_block_scale), ks(p.k_scale), v(p.v), vp(p.v_param), smem(smem_) {
    FullTileScales<Cfg>::init(smem, p);
  }
  __device__ __forceinline__ void copy(uint32_t st, const uint32_t* ring) {
    k.read_ids(ring);
    if constexpr (Layout::k8_bytes > 0) k8.read_ids(ring);
    if constexpr (T::kMergedScales) {
      scales.read_ids(smem, ring);
    } else {
      if constexpr (Layout::k_block_scale_bytes > 0) bs.read_ids(ring);
      if constexpr (Layout::k_scale_bytes > 0) ks.read_ids(ring);
      if constexpr (Layout::v_param_bytes > 0) vp.read_ids(ring);
    }
    v.read_ids(ring);
    // All ring reads before the first cp.async: ptxas pads an LDGSTS that follows an LDS with three
    // `@!PT LDS` (issued, never executed); interleaved, that wastes 24 issue slots per tile.
    asm volatile("" ::: "memory");
    k.issue(st + T::kOffK);
    if constexpr (Layout::k8_bytes > 0) k8.issue(st + T::kOffK8);
    if constexpr (T::kMergedScales) {
      scales.issue(st);
    } else {
      if constexpr (Layout::k_block_scale_bytes > 0) bs.issue(st + T::kOffBs);
      if constexpr (Layout::k_scale_bytes > 0) ks.issue(st + T::kOffKs);
      if constexpr (Layout::v_param_bytes > 0) vp.issue(st + T::kOffVp);
    }
    v.issue(st + T::kOffV);
  }
};

// A request's last tile (bytes past the length zero-filled).
template <class Cfg>
__device__ __forceinline__ void load_partial_tile(uint32_t st, const DecodeParams& p, const uint32_t* ph, int valid) {
  using T = DecodeTraits<Cfg>;
  using Layout = typename T::Layout;
  load_field<Cfg, Layout::k_bytes, true, false>(st + T::kOffK, p.k, ph, valid);
  if constexpr (Layout::k8_bytes > 0)
    load_field<Cfg, Layout::k8_bytes, false, false>(st + T::kOffK8, p.k8, ph, valid);
  if constexpr (Layout::k_block_scale_bytes > 0)
    load_field<Cfg, Layout::k_block_scale_bytes, false, false>(st + T::kOffBs, p.k_block_scale, ph, valid);
  if constexpr (Layout::k_scale_bytes > 0)
    load_field<Cfg, Layout::k_scale_bytes, false, false>(st + T::kOffKs, p.k_scale, ph, valid);
  load_field<Cfg, Layout::v_bytes, false, true>(st + T::kOffV, p.v, ph, valid);
  if constexpr (Layout::v_param_bytes > 0)
    load_field<Cfg, Layout::v_param_bytes, false, false>(st + T::kOffVp, p.v_param, ph, valid);
}

}  // namespace
