"""A faster drop-in for `engine.hf_generate`: a preallocated-KV-cache sampling loop, fully batched.

    fast_generate(model, tok, prompts, max_new_tokens, sampling, batch_size=256) -> list[Generation]

Same signature, same left padding, same positions (`attention_mask.cumsum - 1`, as `generate`), same
logits processing (min_new_tokens from `model.generation_config`, then temperature, top-k, top-p, in
transformers' order, on float32 logits) and the same post-processing of rows as `hf_generate`; with
greedy sampling it yields exactly the tokens `hf_generate` yields (tests/test_fast_sampler.py).

Why it is faster on small models: `generate` spends most of a decode step in Python (mask building,
cache bookkeeping, logits-processor objects, stopping criteria, ~20 nn.Module calls per layer) and
grows its KV cache with `torch.cat` every token. Here a decode step is ~25 tensor ops per layer on a
cache allocated once, with q/k/v and gate/up projections fused into one matmul each. With `compiled=True`
(the hf engine under `train.compile`) the decode step is one torch.compile graph (`compiled_step`): every
slot of the cache is attended with a running mask, so the shapes stay fixed through a generation, and rows
and cache length are dynamic sizes, so one graph serves every batch (64 rows x 32 tokens on the toy student,
one thread: about 95 ms against 140-160 ms eager, 2026-12-03).

The decoder is written out for the Llama family with optional per-head q/k RMSNorm (Qwen3, Qwen2,
Llama, Mistral without sliding window) and default RoPE. Any other model, or a generation_config
asking for a processor this loop does not implement, falls back to `hf_generate` (so calling it is
always correct). `fast_generate_with_logprobs` also returns each generated token's log-probability
under the sampling temperature (what `HFEngine.score` recomputes with a separate forward pass).
"""

from __future__ import annotations

import bisect
import logging

import torch
import torch.nn.functional as F

from composer.runtime.engine import Generation, Sampling, budgets, cut, hf_generate
from composer.runtime.onednn import linear
from composer.stops import of

log = logging.getLogger("composer")
_TOLD: set[str] = set()  # reasons a compiled decode step could not be used, said once each

_FAMILIES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")


def supported(model) -> tuple[bool, str]:
    """Whether the written-out decoder covers this model ('' or the reason it does not)."""
    name = type(model).__name__
    if name not in _FAMILIES:
        return False, f"{name} is not one of {', '.join(_FAMILIES)}"
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if (rope.get("rope_type") or rope.get("type") or "default") != "default":
        return False, f"rope type {rope.get('rope_type') or rope.get('type')}"
    if getattr(cfg, "use_sliding_window", False) or (getattr(cfg, "sliding_window", None) and name == "MistralForCausalLM"):
        return False, "sliding-window attention"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return False, f"activation {cfg.hidden_act}"
    if getattr(cfg, "mlp_bias", False):
        return False, "MLP bias"
    g = model.generation_config
    plain = (
        (g.repetition_penalty in (None, 1.0)) and not g.no_repeat_ngram_size and not g.bad_words_ids
        and not g.suppress_tokens and not g.begin_suppress_tokens and not g.forced_bos_token_id
        and not g.forced_eos_token_id and g.min_p is None and not getattr(g, "sequence_bias", None)
        and not g.min_length and g.num_beams in (None, 1)
    )
    if not plain:
        return False, "the generation_config asks for a logits processor this loop does not implement"
    return True, ""


class _Weights:
    """The decoder's weights, fused where a matmul can be shared (read once per call); `version`: the in-place
    version counters of the parameters they were read from (what a PrefixCache entry is valid for)."""

    def __init__(self, model):
        cfg = model.config
        inner = model.model
        self.eps = cfg.rms_norm_eps
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.rotary = inner.rotary_emb
        self.layers = []
        for layer in inner.layers[: cfg.num_hidden_layers]:
            a, m = layer.self_attn, layer.mlp
            biases = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
            self.layers.append(dict(
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                qkv_b=torch.cat(biases) if all(b is not None for b in biases) else None,
                # per-head q/k RMSNorm weights stacked over the q and k heads: one norm call for both
                qk_norm=torch.cat([a.q_norm.weight.expand(self.n_heads, -1), a.k_norm.weight.expand(self.n_kv, -1)])
                if hasattr(a, "q_norm") else None,
                o=a.o_proj.weight, o_b=a.o_proj.bias,
                gate_up=torch.cat([m.gate_proj.weight, m.up_proj.weight]), down=m.down_proj.weight,
            ))
        read = [self.embed, self.final_norm, self.lm_head, *(t for layer in inner.layers[: cfg.num_hidden_layers]
                                                               for t in layer.parameters())]
        self.version = tuple(t._version for t in read)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (float32 statistics, weight applied in the input dtype); `F.rms_norm` computes
    the same x * rsqrt(mean(x^2) + eps) in fewer dispatches (bitwise equal in float32, checked by the tests)."""
    dtype = x.dtype
    return w * F.rms_norm(x.to(torch.float32), (x.shape[-1],), None, eps).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _attend(q, k, v, bias, scale: float) -> torch.Tensor:
    """Attention of q [B, nh, T, d] over k/v [B, nkv, S, d] with the additive bias [B, 1, T, S]; GQA heads
    share their group's k/v (head h reads kv head h // (nh / nkv), as transformers' repeat_kv).

    A decode step (T = 1) runs as two batched matmuls over the kv groups: one query row per head is a shape
    CPU scaled_dot_product_attention serves slowly (its flash kernel tiles queries; ~1.3x the matmul pair's
    time at 64 rows x 50 keys, the toy student, one thread). Prefill keeps scaled_dot_product_attention."""
    B, nh, T, d = q.shape
    nkv = k.shape[1]
    if T != 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=nh != nkv)
    qg = q.reshape(B, nkv, nh // nkv, d)  # [B, nkv, g, d]: a group's query heads as rows
    att = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale).add_(bias)  # [B, nkv, g, S] (+ [B, 1, 1, S])
    return torch.matmul(att.softmax(-1), v).reshape(B, nh, 1, d)


def _forward(W: _Weights, ids, cos, sin, mask, cache_k, cache_v, start: int | torch.Tensor) -> torch.Tensor:
    """Run tokens `ids` [B, T] written at cache slots start..start+T; returns the last position's hidden [B, H].

    cos/sin [B, T, D]; mask [B, 1, T, start+T]: bool (True = may attend) or additive (0 / -inf);
    cache_k/v: per layer [B, KV, S, D]. With `start` a tensor of slots [T] (the compiled decode step), the
    tokens are written there and attend over all S slots (mask [B, 1, T, S]): every call has the same shapes.
    """
    B, T = ids.shape
    nh, nkv, d = W.n_heads, W.n_kv, W.head_dim
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=W.embed.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    x = F.embedding(ids, W.embed)  # [B, T, H]
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, D]
    fixed = isinstance(start, torch.Tensor)
    end = None if fixed else start + T
    for i, L in enumerate(W.layers):
        h = _rms(x, L["ln1"], W.eps)
        qkv = linear(h, L["qkv"], L["qkv_b"])  # [B, T, (nh + 2 nkv) d]
        qk, v = qkv.split(((nh + nkv) * d, nkv * d), dim=-1)
        qk = qk.view(B, T, nh + nkv, d)  # q and k heads side by side: norm and RoPE are per head
        if L["qk_norm"] is not None:
            qk = _rms(qk, L["qk_norm"], W.eps)
        qk = _rotate(qk.transpose(1, 2), cos, sin)  # [B, nh + nkv, T, d]
        q, k = qk[:, :nh], qk[:, nh:]
        v = v.view(B, T, nkv, d).transpose(1, 2)  # [B, nkv, T, d]
        if fixed:
            cache_k[i].index_copy_(2, start, k)
            cache_v[i].index_copy_(2, start, v)
        else:
            cache_k[i][:, :, start:end] = k
            cache_v[i][:, :, start:end] = v
        o = _attend(q, cache_k[i][:, :, :end], cache_v[i][:, :, :end], mask, d ** -0.5)  # [B, nh, T, d]
        x = x + linear(o.transpose(1, 2).reshape(B, T, nh * d), L["o"], L["o_b"])
        h = _rms(x, L["ln2"], W.eps)
        gate, up = linear(h, L["gate_up"]).chunk(2, dim=-1)
        x = x + linear(F.silu(gate) * up, L["down"])
    return _rms(x[:, -1], W.final_norm, W.eps)  # [B, H]


def _decode_step(W: _Weights, tok, cos, sin, bias, slot, cache_k, cache_v) -> torch.Tensor:
    """One decode step at fixed shapes, the function `compiled_step` compiles: tokens tok [B] go to cache slot
    `slot` [1] and attend over every slot of the cache (bias [B, 1, 1, S] masks the pads and the slots not
    written yet); returns the next logits [B, V]. cos/sin [B, 1, D]."""
    return linear(_forward(W, tok[:, None], cos, sin, bias, cache_k, cache_v, slot), W.lm_head)


_COMPILED = None


def compiled_step():
    """`_decode_step` under torch.compile (built once per process; rows and cache length are dynamic sizes,
    so one graph serves every call of a model's shapes)."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(_decode_step, fullgraph=True)
    return _COMPILED


def _next_token(logits: torch.Tensor, sampling: Sampling, block_eos: bool, eos: torch.Tensor):
    """transformers' processing order on float32 logits: min_new_tokens (every stop token blocked), temperature,
    top-k, top-p."""
    scores = logits.float()  # [B, V]
    if block_eos:
        scores[:, eos] = float("-inf")
    if sampling.greedy:
        return scores.argmax(-1)
    if sampling.temperature != 1.0:
        scores = scores / sampling.temperature
    if sampling.top_k and sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        srt, idx = torch.sort(scores, descending=False)
        remove = srt.softmax(-1).cumsum(-1) <= (1 - sampling.top_p)
        remove[:, -1] = False  # keep at least one token
        scores = scores.masked_fill(remove.scatter(1, idx, remove), float("-inf"))
    return torch.multinomial(scores.softmax(-1), 1).squeeze(1)


class PrefixCache:
    """The keys and values of the rows one sampling call wrote (prompt + generated tokens), kept for the next
    call with the same weights: a prompt that extends one of those rows (a guided row's next chunk: its prompt,
    the accepted text, a correction) is prefilled from there instead of from its first token.

    RoPE positions count a row's real tokens from 0 whatever the padding (`attention_mask.cumsum - 1`), so a
    row's cached keys and values hold for any prompt that starts with its tokens. Entries are dropped when the
    weights change (the parameters' in-place version counters) and replaced by each call's rows."""

    def __init__(self):
        self.version: tuple | None = None
        self.keys: list[tuple] = []  # sorted token tuples
        self.where: dict[tuple, tuple] = {}  # tokens -> (k per layer, v per layer, row, first slot)

    def valid_for(self, W: _Weights) -> bool:
        return self.version == W.version

    def longest(self, prompt: list[int]) -> tuple[int, tuple | None]:
        """(c, entry): the longest cached row sharing the first c tokens of `prompt` (0, None if none)."""
        key = tuple(prompt)
        i = bisect.bisect_left(self.keys, key)
        best, entry = 0, None
        for j in (i - 1, i):  # the longest common prefix is with a sorted neighbour
            if 0 <= j < len(self.keys):
                other = self.keys[j]
                c = next((t for t, (a, b) in enumerate(zip(key, other)) if a != b), min(len(key), len(other)))
                if c > best:
                    best, entry = c, self.where[other]
        return best, entry

    def store(self, W: _Weights, rows: list[list[int]], cache_k, cache_v, first: list[int]) -> None:
        self.version = W.version
        self.where = {tuple(r): (cache_k, cache_v, i, first[i]) for i, r in enumerate(rows)}
        self.keys = sorted(self.where)


@torch.no_grad()
def _generate_chunk(W: _Weights, chunk, limits, sampling, pad, stops, min_new, want_logprobs,
                    prefixes: PrefixCache | None = None, compiled: bool = False):
    """Sample every prompt of `chunk` up to its own limit (the loop ends when every row has stopped: at its budget
    or at the first of `stops`, the model's stop tokens, composer/stops.py)).
    With `prefixes`, prompts extending a row of the previous call are prefilled from its cache (and this
    call's rows are kept for the next). `compiled`: the decode steps run `compiled_step` (same tokens and
    log-probs up to float rounding)."""
    device = W.embed.device
    eos = torch.tensor(stops.ids, dtype=torch.long, device=device)  # [K] every stop token
    max_new_tokens = max(max(limits), 1)
    limit = torch.tensor(limits, device=device)  # [B] per-row token budget
    B, P = len(chunk), max(len(p) for p in chunk)
    S = P + max_new_tokens
    ids = torch.tensor([[pad] * (P - len(p)) + list(p) for p in chunk], dtype=torch.long, device=device)  # [B, P]
    # key slots holding real tokens; generated slots always attend (as generate's growing attention_mask)
    valid = torch.arange(S, device=device)[None] >= torch.tensor([P - len(p) for p in chunk], device=device)[:, None]
    # positions as generate computes them: cumsum(attention_mask) - 1, pads at 1
    lens = valid[:, :P].sum(1)  # [B]
    pos = (valid[:, :P].long().cumsum(1) - 1).masked_fill(~valid[:, :P], 1)  # [B, P]
    table_pos = torch.arange(S, device=device)[None]
    dtype = W.embed.dtype
    cos_t, sin_t = W.rotary(W.embed, table_pos)  # [1, S, D] (the model's own RoPE module)
    cos_t, sin_t = cos_t[0], sin_t[0]  # [S, D]
    # prefill once per distinct prompt (a group's G samples share theirs), then copy its cache to its rows
    first: dict[tuple, int] = {}
    owner = [first.setdefault(tuple(p), len(first)) for p in chunk]  # row -> distinct prompt
    uniq = torch.tensor([owner.index(u) for u in range(len(first))], device=device)  # [U] a row per prompt
    U = len(first)
    # zeros when every slot is attended (compiled): a key not written yet is masked, but garbage in it would
    # still reach the softmax as 0 x NaN
    alloc = torch.zeros if compiled else torch.empty
    cache_k = [alloc((B, W.n_kv, S, W.head_dim), dtype=dtype, device=device) for _ in W.layers]
    cache_v = [alloc((B, W.n_kv, S, W.head_dim), dtype=dtype, device=device) for _ in W.layers]
    # the prompts' cache: [U, KV, P, D] per layer, copied to the rows that share each prompt
    # (zeros with a prefix cache: the pad slots before a cached prompt are never written, and a masked key's
    # garbage would still reach the softmax as 0 x NaN)
    alloc = torch.zeros if prefixes is not None else torch.empty
    pre_k = [alloc((U, W.n_kv, P, W.head_dim), dtype=dtype, device=device) for _ in W.layers]
    pre_v = [alloc((U, W.n_kv, P, W.head_dim), dtype=dtype, device=device) for _ in W.layers]
    # prefill: causal over real prompt tokens; a pad query attends to itself only (keeps it finite)
    causal = torch.ones((P, P), dtype=torch.bool, device=device).tril()
    mask = (causal[None] & valid[uniq, None, :P]) | torch.eye(P, dtype=torch.bool, device=device)[None]
    # slots [0, P - T) of every prompt come from the cache of the previous call's rows (T = P without one)
    T = _from_cache(prefixes, W, [chunk[u] for u in uniq.tolist()], P, pre_k, pre_v) if prefixes else P
    hidden = _forward(W, ids[uniq, P - T:], cos_t[pos[uniq, P - T:]], sin_t[pos[uniq, P - T:]],
                      mask[:, None, P - T:], pre_k, pre_v, P - T)
    rows = torch.tensor(owner, device=device)  # [B] row -> its prompt's prefill
    for c, pre in zip(cache_k + cache_v, pre_k + pre_v):
        c[:, :, :P] = pre[rows]
    hidden = hidden[rows]
    out = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=device)
    lps = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=device) if want_logprobs else None
    done = torch.zeros(B, dtype=torch.bool, device=device)
    # the decode steps' additive mask over every key slot, built once: [B, 1, 1, S] (0 or -inf)
    bias = torch.zeros((B, 1, 1, S), dtype=dtype, device=device).masked_fill_(~valid[:, None, None], float("-inf"))
    if compiled:  # every slot is attended: the generated ones open as they are written
        step = compiled_step()
        bias[:, :, :, P:] = float("-inf")
        for x, slots in ((bias, 3), *((c, 2) for c in cache_k + cache_v)):  # one graph for any rows and length
            torch._dynamo.maybe_mark_dynamic(x, 0)
            torch._dynamo.maybe_mark_dynamic(x, slots)
    logits = linear(hidden, W.lm_head)  # [B, V]
    n = 0
    for t in range(max_new_tokens):
        tok = _next_token(logits, sampling, t < min_new, eos)
        tok = tok.masked_fill(done, pad)
        out[:, t] = tok
        if want_logprobs:
            temp = 1.0 if sampling.greedy else sampling.temperature
            lp = torch.log_softmax(logits.float() / temp, dim=-1).gather(1, tok[:, None]).squeeze(1)
            lps[:, t] = lp.masked_fill(done, 0.0)
        done = done | torch.isin(tok, eos) | (limit <= t + 1)
        n = t + 1
        if t == max_new_tokens - 1 or bool(done.all()):
            break
        p = (lens + t)[:, None]  # [B, 1] position of the token just sampled
        if compiled:
            bias[:, :, :, P + t] = 0.0
            cos, sin = cos_t[p], sin_t[p]
            for x in (tok, cos, sin):
                torch._dynamo.maybe_mark_dynamic(x, 0)
            logits = step(W, tok, cos, sin, bias, torch.full((1,), P + t, device=device), cache_k, cache_v)
        else:
            hidden = _forward(W, tok[:, None], cos_t[p], sin_t[p], bias[:, :, :, : P + t + 1], cache_k, cache_v, P + t)
            logits = linear(hidden, W.lm_head)  # [B, V]
    rows = [r[: max(b, 0)] for r, b in zip(out[:, :n].tolist(), limits)]
    if prefixes is not None:
        # keys and values exist for the prompt and every sampled token but the last (never fed back)
        real = [stops.cut(r)[0] for r in rows]
        prefixes.store(W, [p + r[: min(len(r), n - 1)] for p, r in zip(chunk, real)], cache_k, cache_v,
                       [P - len(p) for p in chunk])
    return rows, ([lp[: len(r)] for lp, r in zip(lps[:, :n].tolist(), rows)] if want_logprobs else None)


def _from_cache(prefixes: PrefixCache, W: _Weights, prompts: list[list[int]], P: int, pre_k, pre_v) -> int:
    """Copy into pre_k/pre_v [U, KV, P, D] (prompts right-aligned at P) the cached keys and values of each
    prompt's longest cached prefix, as far as every prompt can start its prefill at one slot P - T; returns T,
    the prefill's width (P when nothing is cached). At least a prompt's last token is always run: its hidden
    state gives the first sampled token's logits."""
    if not prefixes.valid_for(W):
        return P
    found = [prefixes.longest(p) for p in prompts]
    T = max(len(p) - min(c, len(p) - 1) for p, (c, _e) in zip(prompts, found))
    if T >= P:
        return P
    # one indexed copy per layer tensor and cache source: (prompt u, slot d) <- (cached row r, slot s)
    moves: dict[int, tuple[list, list[list[int]]]] = {}
    for u, (p, (_c, entry)) in enumerate(zip(prompts, found)):
        keep = len(p) - T  # this prompt's tokens before slot P - T
        if keep <= 0:
            continue
        ks, vs, row, first = entry
        idx = moves.setdefault(id(ks), (ks + vs, [[], [], [], []]))[1]
        idx[0] += [u] * keep
        idx[1] += range(P - len(p), P - T)
        idx[2] += [row] * keep
        idx[3] += range(first, first + keep)
    for srcs, idx in moves.values():
        u, d, r, s = (torch.tensor(i, device=pre_k[0].device) for i in idx)
        for dst, src in zip(pre_k + pre_v, srcs):
            dst[u, :, d] = src[r, :, s]  # [n, KV, D]
    return T


def _post(row: list[int], stops, pad: int, greedy: bool) -> Generation:
    """The row as `hf_generate` reports it: cut at its first stop token (`stops`, composer/stops.py)."""
    kept, finished = stops.cut(row)
    if finished:
        return Generation(kept, True)
    return Generation([t for t in row if t != pad] if greedy else row, False)


@torch.no_grad()
def fast_generate_with_logprobs(model, tok, prompts: list[list[int]], max_new_tokens: int | list[int],
                                sampling: Sampling, batch_size: int = 256, prefixes: PrefixCache | None = None,
                                compiled: bool = False) -> tuple[list[Generation], list[list[float]] | None]:
    """`fast_generate`, plus each generated token's log-prob under the sampling temperature (None on fallback).
    `max_new_tokens` is one budget or one per prompt. `prefixes`: see PrefixCache (one batch per call: a
    call of more than `batch_size` prompts does not use it). `compiled`: decode steps through `compiled_step`."""
    limits = budgets(max_new_tokens, len(prompts))
    ok, why = supported(model)
    if not ok:
        if compiled and why not in _TOLD:
            _TOLD.add(why)
            log.warning("train.compile: the rollout engine's decode step is not compiled (%s: the KV-cache sampler "
                        "does not cover it, so transformers' generate samples, uncompiled); the log-prob forwards "
                        "are compiled", why)
        gens = hf_generate(model, tok, prompts, max(limits, default=1), sampling, batch_size)
        return [cut(g, b) for g, b in zip(gens, limits)], None
    W = _Weights(model)
    pad, stops = tok.pad_token_id, of(tok)
    min_new = model.generation_config.min_new_tokens or 0
    gens: list[Generation] = []
    logprobs: list[list[float]] = []
    for i in range(0, len(prompts), batch_size):
        rows, lps = _generate_chunk(W, prompts[i: i + batch_size], limits[i: i + batch_size], sampling,
                                    pad, stops, min_new, True, prefixes if len(prompts) <= batch_size else None,
                                    compiled)
        for row, lp in zip(rows, lps):
            g = _post(row, stops, pad, sampling.greedy)
            gens.append(g)
            logprobs.append(lp[: len(g.tokens)])
    return gens, logprobs


@torch.no_grad()
def fast_generate(model, tok, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                  batch_size: int = 256) -> list[Generation]:
    """Drop-in for `engine.hf_generate` (same arguments, same result for greedy sampling)."""
    ok, _why = supported(model)
    if not ok:
        return hf_generate(model, tok, prompts, max_new_tokens, sampling, batch_size)
    W = _Weights(model)
    pad, stops = tok.pad_token_id, of(tok)
    min_new = model.generation_config.min_new_tokens or 0
    gens: list[Generation] = []
    for i in range(0, len(prompts), batch_size):
        rows, _ = _generate_chunk(W, prompts[i: i + batch_size], [max_new_tokens] * len(prompts[i: i + batch_size]),
                                  sampling, pad, stops, min_new, False)
        gens += [_post(row, stops, pad, sampling.greedy) for row in rows]
    return gens
