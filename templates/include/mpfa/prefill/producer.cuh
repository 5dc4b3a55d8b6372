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

__device__ __forceinline__ Ring ring_at(uint32_t base_addr) {
  Ring r;
  r.base = base_addr;
  r.full_k = base_addr + kOffBar;
  r.full_v = r.full_k + 8 * kStages;
  r.empty = r.full_v + 8 * kStages;
  return r;
}

__device__ __forceinline__ void init_ring(const Ring& ring) {
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    mpfa::pipe::mbar_init(ring.full_k + 8 * s, 1);
    mpfa::pipe::mbar_init(ring.full_v + 8 * s, 1);
    mpfa::pipe::mbar_init(ring.empty + 8 * s, kConsumers);   // every consumer thread
  }
  mpfa::pipe::mbar_init_fence();
}

// The producer thread's whole work: every KV tile of the CTA's item, in the order the consumers take them.
__device__ __forceinline__ void produce(const PrefillParams& p, const Item& it, const Ring& ring) {
  const int nh = p.num_qo_heads;
  const int b = it.b, hq = it.hq, hk = it.hk, n_tiles = it.n_tiles;
  const int kvt0 = p.kv_tile_base[b];
  const bool digits = comp_digits(p);   // the compensation digits instead of fb
  for (int g = 0; g < n_tiles; ++g) {
    const int s = g % kStages;
    if (g >= kStages) mpfa::pipe::mbar_wait(ring.empty + 8 * s, ((g / kStages) - 1) & 1);
    const int64_t img = int64_t(kvt0 + g) * p.num_kv_heads + hk;
    const uint32_t fk = ring.full_k + 8 * s, fv = ring.full_v + 8 * s;
    uint32_t kbytes = kImgK;
    if constexpr (kQuant) kbytes += digits ? kFac + kImgCd : p.fb != nullptr ? 2 * kFac : kFac;
    mpfa::pipe::mbar_expect_tx(fk, kbytes);
    mpfa::pipe::bulk_g2s(ring.base + kOffK + s * kImgK, p.k_img + img * kImgK, kImgK, fk);
    if constexpr (kQuant) {
      mpfa::pipe::bulk_g2s(ring.base + kOffFa + s * kFac, p.fa + img * kBN, kFac, fk);
      if (digits)
        mpfa::pipe::bulk_g2s(ring.base + kOffCd + s * kImgCd, p.cd_img + (int64_t(kvt0 + g) * nh + hq) * kImgCd,
                             kImgCd, fk);
      else if (p.fb != nullptr)
        mpfa::pipe::bulk_g2s(ring.base + kOffFb + s * kFac, p.fb + (int64_t(kvt0 + g) * nh + hq) * kBN, kFac, fk);
    }
    mpfa::pipe::mbar_expect_tx(fv, kImgV);
    mpfa::pipe::bulk_g2s(ring.base + kOffV + s * kImgV, p.v_img + img * kImgV, kImgV, fv);
  }
}

}  // namespace
