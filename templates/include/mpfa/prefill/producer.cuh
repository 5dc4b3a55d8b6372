// The producer warpgroup's loads: one thread streams each KV tile's images (K with its fa / fb vectors or
// the compensation digits, then V^T) from the workspace into a kStages-deep ring of shared-memory stages with bulk copies
// (cp.async.bulk). A stage's full barriers carry the transaction bytes; its empty barrier counts the
// consumer threads' releases.
#pragma once
#include <cstdint>
#include "mpfa/pipeline.cuh"
#include "mpfa/prefill/kernel_traits.cuh"
#include "mpfa/prefill/params.cuh"
#include "mpfa/prefill/tile_scheduler.cuh"

namespace {

// The K/V ring in shared memory. The item's g-th KV tile uses stage g % kStages and waits for phase
// (g / kStages) & 1 of that stage's barriers.
struct Ring {
  uint32_t base;     // shared-memory address of the 1024-aligned layout (kernel_traits.cuh)
  uint32_t full_k;   // kStages barriers: K image (+ fa, fb) landed
  uint32_t full_v;   // kStages barriers: V^T image landed
  uint32_t empty;    // kStages barriers: every consumer thread is done with the stage
};

template <class Kt>
__device__ __forceinline__ Ring ring_at(uint32_t base_addr) {
  Ring r;
  r.base = base_addr;
  r.full_k = base_addr + Kt::kOffBar;
  r.full_v = r.full_k + 8 * Kt::kStages;
  r.empty = r.full_v + 8 * Kt::kStages;
  return r;
}

template <class Kt>
__device__ __forceinline__ void init_ring(const Ring& ring) {
#pragma unroll
  for (int s = 0; s < Kt::kStages; ++s) {
    mpfa::pipe::mbar_init(ring.full_k + 8 * s, 1);
    mpfa::pipe::mbar_init(ring.full_v + 8 * s, 1);
    mpfa::pipe::mbar_init(ring.empty + 8 * s, Kt::kConsumers);   // every consumer thread
  }
  mpfa::pipe::mbar_init_fence();
}

// The producer thread's whole work: every KV tile of the CTA's item, in the order the consumers take them.
template <class Kt>
__device__ __forceinline__ void produce(const PrefillParams& p, const Item& it, const Ring& ring) {
  const int nh = p.num_qo_heads;
  const int b = it.b, hq = it.hq, hk = it.hk, n_tiles = it.n_tiles;
  const int kvt0 = p.kv_tile_base[b];
  const bool digits = comp_digits<Kt>(p);   // the compensation digits instead of fb
  for (int g = 0; g < n_tiles; ++g) {
    const int s = g % Kt::kStages;
    if (g >= Kt::kStages) mpfa::pipe::mbar_wait(ring.empty + 8 * s, ((g / Kt::kStages) - 1) & 1);
    const int64_t img = int64_t(kvt0 + g) * p.num_kv_heads + hk;
    const uint32_t fk = ring.full_k + 8 * s, fv = ring.full_v + 8 * s;
    uint32_t kbytes = Kt::kImgK;
    if constexpr (Kt::kQuant)
      kbytes += digits ? Kt::kFac + Kt::kImgCd : p.fb != nullptr ? 2 * Kt::kFac : Kt::kFac;
    mpfa::pipe::mbar_expect_tx(fk, kbytes);
    mpfa::pipe::bulk_g2s(ring.base + Kt::kOffK + s * Kt::kImgK, p.k_img + img * Kt::kImgK, Kt::kImgK, fk);
    if constexpr (Kt::kQuant) {
      mpfa::pipe::bulk_g2s(ring.base + Kt::kOffFa + s * Kt::kFac, p.fa + img * Kt::kBN, Kt::kFac, fk);
      if (digits)
        mpfa::pipe::bulk_g2s(ring.base + Kt::kOffCd + s * Kt::kImgCd,
                             p.cd_img + (int64_t(kvt0 + g) * nh + hq) * Kt::kImgCd, Kt::kImgCd, fk);
      else if (p.fb != nullptr)
        mpfa::pipe::bulk_g2s(ring.base + Kt::kOffFb + s * Kt::kFac, p.fb + (int64_t(kvt0 + g) * nh + hq) * Kt::kBN,
                             Kt::kFac, fk);
    }
    mpfa::pipe::mbar_expect_tx(fv, Kt::kImgV);
    mpfa::pipe::bulk_g2s(ring.base + Kt::kOffV + s * Kt::kImgV, p.v_img + img * Kt::kImgV, Kt::kImgV, fv);
  }
}

}  // namespace
