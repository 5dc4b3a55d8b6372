"""The KV pool SGLang holds when ``--attention-backend mpfa`` is selected: one :class:`mpfa.PagedKVCache`
in the recipe's compressed format (``recipe.bytes_per_token_head(head_dim)`` bytes per token and KV head),
built by the plugin's hook on ``KVCacheConfigurator._build_mha_kv_pool``.

Slot ``s`` of SGLang's allocator is token ``s % page_size`` of page ``s // page_size``; the pool has
``size + page_size`` slots like SGLang's own (page 0 holds slot 0, the padding slot dummy writes go to).
Imports SGLang: use only inside an SGLang process.
"""
from __future__ import annotations

import logging

import torch

from ..append import append_kv
from ..kv_cache import PagedKVCache
from .calibration import fixes_scales
from .compat import sglang_attr, sglang_version
from .settings import MpfaSettings

logger = logging.getLogger(__name__)

KVCache = sglang_attr("sglang.srt.mem_cache.memory_pool", "KVCache")


class MpfaTokenToKVPool(KVCache):
    """SGLang ``KVCache`` whose storage is an mpfa :class:`PagedKVCache` (all layers of this rank)."""

    def __init__(self, size: int, *, page_size: int, settings: MpfaSettings, head_num: int, head_dim: int,
                 layer_num: int, device, enable_memory_saver: bool = False, start_layer: int | None = None,
                 end_layer: int | None = None, dtype: torch.dtype = torch.bfloat16):
        if enable_memory_saver:
            raise NotImplementedError("--attention-backend mpfa does not support --enable-memory-saver "
                                      f"(SGLang {sglang_version()})")
        super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer,
                         allocation_label=f"mpfa {settings.recipe}")
        self.settings = settings
        self.head_num, self.head_dim, self.v_head_dim = head_num, head_dim, head_dim
        num_pages = -(-(size + page_size) // page_size)
        self.cache = PagedKVCache(settings.recipe, num_layers=layer_num, num_pages=num_pages, page_size=page_size,
                                  num_kv_heads=head_num, head_dim=head_dim, device=device)
        self.layers = [self.cache.layer(i) for i in range(layer_num)]
        # Per layer: mu_K / V channel scales fixed yet? (bf16 stores no scales: always "calibrated")
        self.calibrated = [not (self.cache.recipe.quantized_k or self.cache.recipe.quantized_v)] * layer_num
        self.kernel_backend = settings.kernel_backend
        self._finalize_allocation_log(size)

    # --- what mpfa's backend uses -------------------------------------------------------------------------------
    def local_index(self, layer_id: int) -> int:
        i = layer_id - self.start_layer
        if not 0 <= i < self.layer_num:
            raise ValueError(f"layer_id {layer_id} is outside this pool's layers [{self.start_layer}, "
                             f"{self.start_layer + self.layer_num})")
        return i

    def layer_view(self, layer_id: int):
        return self.layers[self.local_index(layer_id)]

    def report_out_of_range_slots(self) -> int:
        """Log (and reset) the append kernel's count of slots past this pool since the last report, and return
        it: those rows were skipped, so no other request's K/V was touched, but the requests that owned them
        lack them. Reads a device counter (a sync): the backend calls it where extend planning syncs anyway,
        so slots of decode-only steps are reported at the next extend batch."""
        n = self.cache.take_out_of_range_slots()
        if n:
            logger.error("mpfa: append_kv skipped %d slot(s) at or past the KV pool's %d; SGLang handed the pool "
                         "slots it does not have, and those tokens' K/V are missing", n, self.cache.num_slots)
        return n

    def append(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, *, calibrate: bool) -> None:
        """Quantize and write ``k, v [tokens, heads, head_dim]`` (bf16) at slots ``loc``. With ``calibrate``
        (extend batches), a layer's first call that writes a request's slots fixes its mu_K and V channel
        scales from this batch first (mpfa.sglang.calibration: SGLang's dummy forwards write only the
        padding slot); they then stay fixed for the server's life, so cached prefix pages stay valid."""
        i = self.local_index(layer_id)
        k = k.view(-1, self.head_num, self.head_dim)
        v = v.view(-1, self.head_num, self.head_dim)
        if k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
            raise TypeError(f"mpfa appends bf16 K/V, got {k.dtype}/{v.dtype}: serve the model in bfloat16")
        if (not self.calibrated[i] and calibrate
                and fixes_scales(loc, capturing=torch.cuda.is_current_stream_capturing())):
            ignored = self.cache.calibrate(i, k, v, nonfinite="ignore")
            if ignored:
                logger.warning("mpfa: layer %d's first batch held %d non-finite K/V elements; its fixed scales were "
                               "calibrated from the finite ones", layer_id, ignored)
            self.calibrated[i] = True
        append_kv(k, v, self.layers[i], loc if loc.dtype == torch.int64 else loc.long(), backend=self.kernel_backend)

    # --- SGLang's KVCache interface -------------------------------------------------------------------------------
    def get_kv_size_bytes(self):
        k = sum(t.numel() * t.element_size() for n, t in self.cache.fields.items() if n.startswith("k"))
        return k, self.cache.nbytes - k   # V's fields

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The layer's compressed K field (``[pages, heads, page_size, ...]``; int8 for quantized
        recipes): only mpfa's kernels read it."""
        return self.cache.fields["k"][self.local_index(layer_id)]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.cache.fields["v"][self.local_index(layer_id)]

    def get_kv_buffer(self, layer_id: int):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None, *args, **kwargs) -> None:
        # Models that store K/V themselves (save_kv_cache=False paths) land here.
        self.append(layer.layer_id, cache_k, cache_v, loc, calibrate=True)

    def _unsupported(self, what):
        raise NotImplementedError(f"--attention-backend mpfa does not support {what} (SGLang {sglang_version()}): "
                                  "the pool holds mpfa's compressed format")

    def get_cpu_copy(self, indices, mamba_indices=None):
        self._unsupported("hierarchical caching / CPU offload of the KV cache")

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        self._unsupported("hierarchical caching / CPU offload of the KV cache")

    def get_contiguous_buf_infos(self):
        self._unsupported("prefill/decode disaggregation")

    def move_kv_cache(self, tgt_loc, src_loc):
        self._unsupported("moving KV slots (speculative decoding)")
