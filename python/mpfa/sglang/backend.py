"""``MpfaAttnBackend``: SGLang's ``AttentionBackend`` over mpfa's append, prefill and decode wrappers.

Per batch (``init_forward_metadata``): the page table is built on the GPU from SGLang's
``req_to_token`` (slot // page_size, see page_table.py) and the extend or decode wrapper is planned once;
every layer then appends its new K/V into the compressed pool at ``forward_batch.out_cache_loc``
(a layer's first extend batch fixes its mu_K / V scales) and runs the planned wrapper.

CUDA graphs (decode; SGLang 0.5.17's contract in base_attn_backend.py): ``init_cuda_graph_state``
allocates capture-stable page-table buffers and the graphs' split workspace;
``init_forward_metadata_out_graph(fb, in_capture)`` runs outside the graph at capture and before every
replay: it rebuilds the page table with fixed-shape GPU ops and refreshes that batch size's decode
wrapper, which copies the new table into the buffers the captured kernels read.
``init_forward_metadata_in_graph`` is a no-op.

Decode splits come from ``mpfa.decode.server_decode_splits``: eager decode and the CUDA graph a batch
replays cut each request into the same fixed-size KV splits (chosen from the batch-size bucket, the batch's
longest request and its requests' lengths without a graph's padding rows), one CTA per split and KV head
through the work list the wrapper builds from the host lengths (a graph, captured with room for every
request's splits at the server's context length, reads the size and the list from device memory), so a
server gives the same attention outputs with graphs on and off.
"""
from __future__ import annotations

import logging
import math

import torch

from mpfa_jit import get_kernel

from ..decode import BatchDecodeWrapper, resident_ctas, server_decode_splits, workspace_bytes as decode_workspace_bytes
from ..dispatch import device_index, kernel_arch, resolve
from ..prefill import BatchPrefillWrapper, workspace_bytes as prefill_workspace_bytes
from .compat import attn_tp_size, sglang_attr, sglang_version
from .kernels import server_kernel_specs
from .model import UnsupportedModelError, check_model_supported
from .page_table import build_page_table, check_extend_slots, page_table_capacity
from .settings import BACKEND_NAME

logger = logging.getLogger(__name__)

AttentionBackend = sglang_attr("sglang.srt.layers.attention.base_attn_backend", "AttentionBackend")

WORKSPACE_BYTES = 128 << 20   # decode splits and small extends; an extend batch over more keys grows it


def _attn_type_value(layer) -> str:
    t = getattr(layer, "attn_type", None)
    return getattr(t, "value", t) or "decoder"


def _mode_is(mode, name: str) -> bool:
    fn = getattr(mode, name, None)   # ForwardMode predicates differ across SGLang versions
    return bool(fn()) if fn is not None else False


class MpfaAttnBackend(AttentionBackend):
    """``--attention-backend mpfa``."""

    def __init__(self, model_runner):
        super().__init__()
        from .pool import MpfaTokenToKVPool
        sa, mc = model_runner.server_args, model_runner.model_config
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, MpfaTokenToKVPool):
            raise UnsupportedModelError(
                f"--attention-backend {BACKEND_NAME} needs mpfa's KV pool, but SGLang {sglang_version()} built "
                f"{type(pool).__name__}: the plugin's hook on KVCacheConfigurator._build_mha_kv_pool did not apply "
                "(is the mpfa plugin loaded in the scheduler process? SGLANG_PLUGINS must include mpfa if set), or "
                "this model uses a pool family mpfa does not serve")
        self.settings = pool.settings   # resolved once, by the plugin's pool hook
        tp = attn_tp_size()
        self.num_qo_heads = mc.num_attention_heads // tp
        self.num_kv_heads = mc.get_num_kv_heads(tp)
        self.head_dim = mc.head_dim
        arch = ",".join(getattr(mc.hf_config, "architectures", None) or ["?"])
        check_model_supported(
            head_dim=mc.head_dim, v_head_dim=getattr(mc, "v_head_dim", mc.head_dim), num_qo_heads=self.num_qo_heads,
            num_kv_heads=self.num_kv_heads, page_size=self.settings.page_size, recipe=self.settings.recipe,
            use_mla=bool(model_runner.use_mla_backend), sliding_window=model_runner.sliding_window_size,
            logit_cap=float(getattr(mc.hf_config, "attn_logit_softcapping", None) or 0.0),
            is_encoder_decoder=bool(getattr(mc, "is_encoder_decoder", False)), what=f"model ({arch})")
        if getattr(sa, "speculative_algorithm", None):
            raise UnsupportedModelError(f"--attention-backend {BACKEND_NAME} does not support speculative decoding "
                                        f"(--speculative-algorithm {sa.speculative_algorithm})")
        if getattr(mc, "dtype", torch.bfloat16) != torch.bfloat16:
            raise UnsupportedModelError(f"--attention-backend {BACKEND_NAME} serves bfloat16 models; this one runs in "
                                        f"{mc.dtype}: pass --dtype bfloat16")
        self.pool, self.cache = pool, pool.cache
        self.page_size = self.settings.page_size
        self.recipe = self.settings.recipe
        self.device = self.cache.device
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.max_pages_per_req = -(-self.req_to_token.shape[1] // self.page_size)
        self.max_context_len = mc.context_len
        self.sm_scale = 1.0 / math.sqrt(self.head_dim)
        kb = self.settings.kernel_backend
        runs_kernels = resolve(kb, self.device) == "cuda"
        if runs_kernels:
            # Every kernel this server runs, loaded (built if the cache lacks it) before the first batch;
            # python -m mpfa.sglang.warmup builds the same list.
            for spec in server_kernel_specs(num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                                            head_dim=self.head_dim, recipe=self.recipe, page_size=self.page_size,
                                            arch=kernel_arch(self.device)):
                get_kernel(spec)
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        # CTAs of the decode kernel an SM holds: the split count fills whole waves of them
        self.decode_resident_ctas = (resident_ctas(self.recipe, self.head_dim, self.page_size,
                                                   self.num_qo_heads // self.num_kv_heads, device_index(self.device))
                                     if runs_kernels else None)
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = BatchPrefillWrapper(self.workspace, backend=kb)
        self.decode_wrapper = BatchDecodeWrapper(self.workspace, backend=kb)
        self._active = None            # the wrapper this batch's layers run
        self._graph = None             # CUDA-graph buffers (init_cuda_graph_state)
        self._graph_decode = {}        # batch size -> its graphs' wrapper
        self._checked_layers = set()
        logger.info("mpfa backend: recipe %s, compensation %s, page size %d, %d query / %d KV heads, head_dim %d "
                    "(settings from %s)", self.recipe, self.settings.compensation, self.page_size, self.num_qo_heads,
                    self.num_kv_heads, self.head_dim, self.settings.sources)

    # --- per-batch planning -------------------------------------------------------------------------------------
    def _max_pages(self, forward_batch) -> int:
        lens = getattr(forward_batch, "seq_lens_cpu", None)
        if lens is not None and len(lens):
            return max(1, -(-int(lens.max()) // self.page_size))
        return self.max_pages_per_req

    def _page_table(self, forward_batch):
        width = self._max_pages(forward_batch)
        bs = forward_batch.batch_size
        indices = torch.empty(page_table_capacity(bs, width), dtype=torch.int32, device=self.device)
        return build_page_table(self.req_to_token, forward_batch.req_pool_indices[:bs], forward_batch.seq_lens[:bs],
                                self.page_size, width, indices_out=indices)

    def init_forward_metadata(self, forward_batch):
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self._active = None
            return
        if any(_mode_is(mode, m) for m in ("is_target_verify", "is_draft_extend", "is_draft_extend_v2")):
            raise UnsupportedModelError(f"--attention-backend {BACKEND_NAME} does not support speculative decoding")
        indptr, indices, last = self._page_table(forward_batch)
        if mode.is_decode():
            bs = forward_batch.batch_size
            split_size, splits = self._decode_splits(bs, *self._lengths(self._host_lengths(forward_batch, bs)))
            need = decode_workspace_bytes(splits * bs, bs, self.num_qo_heads, self.head_dim)   # at most
            self._grow_workspace(self.decode_wrapper, need, f"decode (batch {bs})")
            # No num_splits: the grid is just this batch's work items (each request's splits of split_size).
            self.decode_wrapper.plan(indptr, indices, last, self.num_qo_heads, self.num_kv_heads, self.head_dim,
                                     self.page_size, sm_scale=self.sm_scale, recipe=self.recipe,
                                     fixed_split_size=split_size)
            self._active = self.decode_wrapper
        else:   # extend / mixed (chunked prefill with a cached prefix; decode rows are 1-token chunks)
            if not torch.cuda.is_current_stream_capturing():   # the prefill plan below syncs anyway
                self.pool.report_out_of_range_slots()
                check_extend_slots(self.req_to_token, forward_batch.req_pool_indices, forward_batch.extend_seq_lens,
                                   forward_batch.positions, forward_batch.out_cache_loc, self.page_size)
            bs = forward_batch.batch_size
            lens = forward_batch.extend_seq_lens_cpu
            qo = torch.zeros(bs + 1, dtype=torch.int32)
            qo[1:] = torch.cumsum(torch.as_tensor(list(lens), dtype=torch.int32), 0)
            self._fit_prefill_workspace(forward_batch, max(lens, default=0))
            self.prefill_wrapper.plan(qo.to(self.device, non_blocking=True), indptr, indices, last, self.num_qo_heads,
                                      self.num_kv_heads, self.head_dim, self.page_size, causal=True,
                                      sm_scale=self.sm_scale, recipe=self.recipe,
                                      compensation=self.settings.compensation)
            self._active = self.prefill_wrapper

    def _decode_splits(self, batch_size: int, longest: int, lengths: list[int] | None = None) -> tuple[int, int]:
        return server_decode_splits(self.num_kv_heads, batch_size, longest, self.max_context_len, self.num_sms,
                                    resident_ctas=self.decode_resident_ctas, lengths=lengths)

    def _host_lengths(self, forward_batch, bs: int) -> list[int] | None:
        """The KV lengths of the batch's ``bs`` rows from their host copy (rows it lacks, a graph's padding,
        at ``get_cuda_graph_seq_len_fill_value()``); None when there is none (graph capture)."""
        lens = getattr(forward_batch, "seq_lens_cpu", None)
        if lens is None or not len(lens):
            return None
        values = [int(n) for n in lens[:bs].tolist()]
        return values + [self.get_cuda_graph_seq_len_fill_value()] * (bs - len(values))

    def _lengths(self, host_lengths: list[int] | None) -> tuple[int, list[int] | None]:
        """The batch's longest request and its requests' KV lengths without a graph's padding rows (length
        ``get_cuda_graph_seq_len_fill_value()``, 1: a decoding request has at least 2), so eager decode and the
        graph replay of a batch plan alike; the server's context length and None without host lengths."""
        if host_lengths is None:
            return self.max_context_len, None
        fill = self.get_cuda_graph_seq_len_fill_value()
        return max(host_lengths), [n for n in host_lengths if n > fill]

    def _grow_workspace(self, wrapper, need: int, why: str):
        """Give ``wrapper`` a workspace of at least ``need`` bytes (doubling), logged with ``why``. Only the
        eager wrappers grow: graph-captured kernels keep the buffers they were captured with."""
        if need > wrapper.workspace_buffer.numel():
            size = max(need, 2 * wrapper.workspace_buffer.numel())
            logger.info("mpfa backend: %s workspace grows to %.0f MiB", why, size / 2**20)
            wrapper.workspace_buffer = torch.empty(size, dtype=torch.uint8, device=self.device)

    def _fit_prefill_workspace(self, forward_batch, max_extend_len: int):
        """The extend kernel's workspace holds MMA-ready images of every key of the batch (about 2 bytes
        per K/V element, mpfa.prefill.workspace_layout): grow the prefill wrapper's buffer when a batch
        needs more. Extend batches are never graph-captured, so replacing the buffer is safe."""
        lens = getattr(forward_batch, "seq_lens_cpu", None)
        if lens is None:
            return
        lens = [int(x) for x in lens]
        need = prefill_workspace_bytes(len(lens), self.num_qo_heads, self.num_kv_heads, self.head_dim, lens,
                                       self.recipe, self.settings.compensation, max_extend_len)
        self._grow_workspace(self.prefill_wrapper, need, f"extend ({sum(lens)} keys in the batch)")

    # --- CUDA graphs (decode) -----------------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args, **kwargs):
        cap = page_table_capacity(max_bs, self.max_pages_per_req, self.cache.num_pages)
        ws = max(1, max(decode_workspace_bytes(self._decode_splits(bs, 1)[1] * bs, bs, self.num_qo_heads,
                                               self.head_dim) for bs in range(1, max_bs + 1)))
        self._graph = dict(
            workspace=torch.empty(ws, dtype=torch.uint8, device=self.device),
            indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
            last=torch.zeros(max_bs, dtype=torch.int32, device=self.device),
            indices=torch.zeros(cap, dtype=torch.int32, device=self.device))

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        if self._graph is None:
            raise RuntimeError("mpfa: init_forward_metadata_out_graph before init_cuda_graph_state")
        mode = forward_batch.forward_mode
        if not mode.is_decode():
            raise UnsupportedModelError(f"--attention-backend {BACKEND_NAME} captures CUDA graphs for decode only, "
                                        f"got forward mode {mode}: launch with --disable-prefill-cuda-graph")
        bs, g = forward_batch.batch_size, self._graph
        indptr, indices, last = build_page_table(
            self.req_to_token, forward_batch.req_pool_indices[:bs], forward_batch.seq_lens[:bs], self.page_size,
            self.max_pages_per_req, indptr_out=g["indptr"][: bs + 1], indices_out=g["indices"],
            last_page_len_out=g["last"][:bs])
        lengths = None if in_capture else self._host_lengths(forward_batch, bs)
        split_size, splits = self._decode_splits(bs, *self._lengths(lengths))
        wrapper = self._graph_decode.get(bs)
        if wrapper is None:   # one wrapper per batch size: every graph of that size reads its buffers
            wrapper = BatchDecodeWrapper(g["workspace"], backend=self.settings.kernel_backend)
            # Planned once per batch size with the full-size index table and a grid of bs x splits work
            # items (splits: what the context length needs); replays refresh the table, the split size and
            # the work list (device memory). Graphs of different sizes share the split workspace: one
            # replays at a time.
            wrapper.plan(indptr, g["indices"], last, self.num_qo_heads, self.num_kv_heads, self.head_dim,
                         self.page_size, sm_scale=self.sm_scale, recipe=self.recipe, num_splits=splits,
                         fixed_split_size=split_size)
            self._graph_decode[bs] = wrapper
        else:   # no host synchronization per step
            wrapper.update_page_table(indptr, g["indices"], last, fixed_split_size=split_size, kv_lengths=lengths)
        self._active = wrapper

    def init_forward_metadata_in_graph(self, forward_batch):
        pass   # the page table is rebuilt outside the graph (out_graph) and read from capture-stable buffers

    # --- forward ------------------------------------------------------------------------------------------------
    def _check_layer(self, layer):
        if layer.layer_id in self._checked_layers:
            return
        check_model_supported(
            head_dim=layer.head_dim, v_head_dim=layer.v_head_dim, num_qo_heads=layer.tp_q_head_num,
            num_kv_heads=layer.tp_k_head_num, page_size=self.page_size, recipe=self.recipe,
            sliding_window=getattr(layer, "sliding_window_size", -1), logit_cap=getattr(layer, "logit_cap", 0.0),
            is_cross_attention=bool(getattr(layer, "is_cross_attention", False)), attn_type=_attn_type_value(layer),
            what=f"layer {layer.layer_id}")
        if (layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim) != (self.num_qo_heads, self.num_kv_heads,
                                                                          self.head_dim):
            raise UnsupportedModelError(
                f"layer {layer.layer_id} has {layer.tp_q_head_num} query / {layer.tp_k_head_num} KV heads of dim "
                f"{layer.head_dim}; the plan has {self.num_qo_heads} / {self.num_kv_heads} / {self.head_dim}")
        if abs(layer.scaling - self.sm_scale) > 1e-6 * self.sm_scale:
            raise UnsupportedModelError(f"layer {layer.layer_id} scales scores by {layer.scaling}, not "
                                        f"1/sqrt(head_dim) = {self.sm_scale}: mpfa plans one scale for all layers")
        self._checked_layers.add(layer.layer_id)

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache, calibrate):
        self._check_layer(layer)
        if self._active is None:
            raise RuntimeError("mpfa: forward before init_forward_metadata")
        if save_kv_cache:
            if k is None or v is None:
                raise UnsupportedModelError(f"layer {layer.layer_id} passes no K/V to attention (KV sharing across "
                                            "layers is not supported by --attention-backend mpfa)")
            self.pool.append(layer.layer_id, k, v, forward_batch.out_cache_loc, calibrate=calibrate)
        q3 = q.reshape(-1, self.num_qo_heads, self.head_dim)
        o = self._active.run(q3 if q3.dtype == torch.bfloat16 else q3.to(torch.bfloat16), self.pool.layer_view(layer.layer_id))
        return o.reshape(-1, self.num_qo_heads * self.head_dim)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, calibrate=True)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, calibrate=False)
