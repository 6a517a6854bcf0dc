"""Loading models and tokenizers: always `from_pretrained` on a directory, the path a real checkpoint takes."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from composer.errors import ModelLoadError


def resolve(name: str) -> str:
    """Map `toy:student` / `toy:teacher` / `toy:instruct` (the student taught InT's proposer task, InT's base) /
    `toy:reward` (a reward model trained to predict the toy verifier, PPO-RM's) / `toy:tools` (the student taught the
    toy's tool task: it calls the calculator now and then) to the toy testbed's cached checkpoints; anything else is
    as given."""
    if name.startswith("toy:"):
        from composer.registry import part

        which = name.split(":", 1)[1]
        paths = part("toy.checkpoints")(**({which: True} if which in ("instruct", "reward", "tools") else {}))
        if which not in paths:
            raise ModelLoadError(f"{name}: the toy testbed has {', '.join(k for k in paths if k != 'tokenizer')}")
        return str(paths[which])
    return name


REMOTE_CODE_HINT = ("the folder ships its own Python code (config.json `auto_map`), which is not run unless the spec "
                    "says `policy.trust_remote_code: true` and the command has --trust-remote-code (or "
                    "COMPOSER_TRUST_REMOTE_CODE=1): only for a folder you trust")


CUSTOM_CODE_ASK = ("set `trust_remote_code: true` where the spec names this model (policy.trust_remote_code, or the "
                   "source's or critic's own) and rerun with --trust-remote-code (or COMPOSER_TRUST_REMOTE_CODE=1)")


def _trusted(requested: bool, path: str = "", what: str = "model") -> bool:
    """Remote code runs only when asked for and allowed by the user (command line or environment). A folder at
    `path` whose config names its own code (`auto_map`) is refused unless it runs: transformers would otherwise
    build its built-in class for a known model_type and train that instead, silently."""
    from composer.registry import remote_code_allowed
    from composer.runtime.paths import custom_code_problem

    if requested and not remote_code_allowed():
        raise ModelLoadError("a model folder's own Python code was asked for without --trust-remote-code "
                             "(or COMPOSER_TRUST_REMOTE_CODE=1); not run")
    why = custom_code_problem(path, bool(requested), CUSTOM_CODE_ASK) if path else None
    if why:
        raise ModelLoadError(f"{what} at {path} does not load: {why}")
    return bool(requested)


def _load_error(what: str, path: str, e: Exception) -> ModelLoadError:
    text = (str(e).strip().splitlines() or [""])[0]
    if "trust_remote_code" in str(e) or "custom code" in str(e):
        return ModelLoadError(f"{what} at {path} does not load: {REMOTE_CODE_HINT}")
    return ModelLoadError(f"{what} at {path} does not load: {type(e).__name__}: {text}")


def load_tokenizer(name: str, trust_remote_code: bool = False):
    """A tokenizer; `trust_remote_code` is always passed (transformers would otherwise ask on the terminal)."""
    path = resolve(name)
    if not Path(path).exists():
        from composer.runtime.paths import tokenizer_problem

        why = tokenizer_problem(path)
        if why:
            raise ModelLoadError(why)
    trust = _trusted(trust_remote_code, path, "tokenizer")
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    except Exception as e:
        raise _load_error("tokenizer", path, e) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(name: str, dtype: str = "float32", trust_remote_code: bool = False):
    """A causal LM; `trust_remote_code` is always passed: a folder with custom code is refused (off) instead of
    transformers asking "run custom code? [y/N]" in the middle of a run."""
    path = resolve(name)
    if not Path(path).exists():  # not the hub's "Repo id must be in the form ..." for a mistyped path
        from composer.runtime.paths import model_problem

        why = model_problem(path, tokenizer_too=False)
        if why:
            raise ModelLoadError(why)
    trust = _trusted(trust_remote_code, path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), trust_remote_code=trust)
    except Exception as e:
        raise _load_error("model", path, e) from None
    from composer.runtime.onednn import use_onednn

    return use_onednn(model)  # float32 products on CPU through oneDNN (composer/runtime/onednn.py)


def prepare_policy(model, cfg):
    """The memory options of `policy:` on a loaded model: gradient checkpointing, then LoRA adapters (peft).
    Returns the module to train (a peft model when `lora` is set)."""
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora is not None:
        from peft import LoraConfig, get_peft_model

        lora = cfg.lora
        try:
            model = get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                     target_modules=lora.target_modules, task_type="CAUSAL_LM"))
        except ValueError as e:  # peft's NoMatchingPeftModuleError: a name the model does not have
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                             if isinstance(m, torch.nn.Linear)})
            raise ModelLoadError(f"policy.lora.target_modules {lora.target_modules}: "
                                 f"{(str(e).splitlines() or [''])[0]}\n    hint: the model's linear modules are "
                                 f"{', '.join(linear) or 'none'} (or write target_modules: all-linear)") from None
    return model


def has_adapter(model) -> bool:
    """A peft model (LoRA adapters on a frozen base)."""
    return hasattr(model, "disable_adapter") and hasattr(model, "merge_and_unload")


class AdapterOff(torch.nn.Module):
    """The base model of a LoRA policy, read with the adapter off: the initial weights without a copy.

    Its forward is the policy's with every adapter disabled; it holds no state of its own (checkpoints
    and loads keep nothing: the base weights never change)."""

    def __init__(self, policy):
        super().__init__()
        object.__setattr__(self, "policy", policy)  # not a submodule: no second copy in state_dict or .to()

    def forward(self, *args, **kwargs):
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)

    @property
    def config(self):
        return self.policy.config

    def parameters(self, recurse: bool = True):
        return self.policy.parameters(recurse)

    def state_dict(self, *args, **kwargs):
        return {}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return None


def merged(model):
    """A plain transformers model of `model` (a LoRA policy with its adapter merged into a copy)."""
    if not has_adapter(model):
        return model
    import copy

    model = copy.deepcopy(model)
    _untie_adapted_outputs(model)
    return model.merge_and_unload()


def _untie_adapted_outputs(peft_model) -> None:
    """An adapter on an output layer whose weight is tied to the input embeddings trained the output side
    only: merging into the shared weight would change the embeddings too, so the copy's output layer gets
    its own weight first (and the config says the two are no longer tied)."""
    base = peft_model.get_base_model()
    out, inp = base.get_output_embeddings(), base.get_input_embeddings()
    if out is None or inp is None:
        return
    layer = getattr(out, "base_layer", None)  # a LoRA-wrapped output layer
    if layer is None or getattr(layer, "weight", None) is None:
        return
    if layer.weight is inp.weight or layer.weight.data_ptr() == inp.weight.data_ptr():
        layer.weight = torch.nn.Parameter(layer.weight.detach().clone(), requires_grad=layer.weight.requires_grad)
        for cfg in (base.config, getattr(base.config, "text_config", None)):
            if cfg is not None and hasattr(cfg, "tie_word_embeddings"):
                cfg.tie_word_embeddings = False


def same_vocabulary(tok_a, tok_b) -> bool:
    return tok_a.get_vocab() == tok_b.get_vocab()


def unwrapped(model):
    """The model under torch.compile's wrapper (`_orig_mod`) and peft's (`get_base_model`)."""
    inner = getattr(model, "_orig_mod", model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def checkpointing(model) -> bool:
    """Whether the model recomputes its layers in the backward pass (gradient checkpointing is on)."""
    inner = unwrapped(model)
    flag = "is_activation_checkpointing" if hasattr(type(inner), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"  # transformers renamed it (the old name warns)
    return bool(getattr(inner, flag, False))


def full_attention(cfg) -> bool:
    """Every layer of this (text) config attends to the whole causal past: no sliding or mixed layer types."""
    types = getattr(cfg, "layer_types", None) or ["full_attention"]
    return all(t == "full_attention" for t in types) and not getattr(cfg, "use_sliding_window", False)


def right_padded(attention_mask: torch.Tensor) -> bool:
    """attention_mask [B, T] bool: each row a prefix of True."""
    lens = attention_mask.sum(1)
    t = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return bool((attention_mask == (t[None] < lens[:, None])).all())


def pack_rows(attention_mask: torch.Tensor, min_saving: float = 0.1):
    """A padding-free layout of right-padded rows: first-fit-decreasing bins of the batch's width.

    attention_mask: [B, T] bool, each row a prefix of True. Returns (order, bins, index) or None when the
    rows are not right-padded or packing would save less than `min_saving` of the tokens:
    bins holds, per packed row, the (row, length) pairs it carries; index [B, T] long points each (row, t)
    into the flattened packed layout [NB * T] (t past the row's length points at its last real token).
    """
    B, T = attention_mask.shape
    lens = attention_mask.sum(1)
    if B < 2 or not right_padded(attention_mask):
        return None
    lens_l = lens.tolist()
    bins: list[list[tuple[int, int]]] = []
    room: list[int] = []
    for r in sorted(range(B), key=lambda i: -lens_l[i]):
        n = max(lens_l[r], 1)
        for b, left in enumerate(room):
            if left >= n:
                bins[b].append((r, n))
                room[b] -= n
                break
        else:
            bins.append([(r, n)])
            room.append(T - n)
    if len(bins) > (1 - min_saving) * B:
        return None
    start = [0] * B
    where = [0] * B
    for b, items in enumerate(bins):
        off = 0
        for r, n in items:
            where[r], start[r] = b, off
            off += n
    t = torch.arange(T)
    base = (torch.tensor(where) * T + torch.tensor(start))[:, None]  # [B, 1]
    last = (torch.tensor(lens_l).clamp(min=1) - 1)[:, None]
    index = base + torch.minimum(t[None], last)  # [B, T]
    return bins, index.to(attention_mask.device)


def _packable(model) -> bool:
    """Models whose attention honours packed position_ids with no attention mask (transformers' sdpa/eager
    masks detect the sequence boundaries from the positions; flash-attention reads them directly)."""
    inner = unwrapped(model)
    if not type(inner).__module__.startswith("transformers."):  # remote code builds its own masks
        return False
    impl = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    return impl in ("sdpa", "eager", "flash_attention_2", "flash_attention_3")


def packed_logits(model, tokens: torch.Tensor, attention_mask: torch.Tensor, read: torch.Tensor | None = None):
    """The model's logits [B, T, V] of right-padded rows, computed on a padding-free layout: one flat sequence
    with per-row attention (`varlen.logits`; compiled or not) where the model supports it; else rows packed
    into bins (`pack_rows`) when that pays, else the padded batch. Real positions get the logits the padded
    forward gives (up to float rounding: same tokens, same positions, same causal scope); pad positions get their row's
    last real position's logits (finite, and masked by every reader). With `read` [B, T] bool, only those
    positions' logits are promised: the flat layout computes the others' partly or not at all (zeros)."""
    from composer.runtime import varlen  # one flat sequence, attention per row

    flat = varlen.logits(model, tokens, attention_mask, read)
    if flat is not None:
        return flat
    # where the flat layout does not apply, a compiled model (train.compile) always takes the bins: one call
    # signature, so one graph serves batches that pack and batches that do not (else each switch recompiles)
    plan = pack_rows(attention_mask, 0.0 if hasattr(model, "_orig_mod") else 0.1) if _packable(model) else None
    if plan is None:
        return model(input_ids=tokens, attention_mask=attention_mask.long()).logits
    bins, index = plan
    B, T = tokens.shape
    ids = tokens.new_zeros(len(bins), T)
    pos = torch.zeros((len(bins), T), dtype=torch.long)
    for b, items in enumerate(bins):
        off = 0
        for r, n in items:
            ids[b, off: off + n] = tokens[r, :n]
            pos[b, off: off + n] = torch.arange(n)
            off += n
        pos[b, off:] = torch.arange(T - off)  # the tail: one more sequence of its own
    # no cache: transformers detects packed sequences only then
    logits = model(input_ids=ids, position_ids=pos.to(tokens.device), use_cache=False).logits  # [NB, T, V]
    return logits.reshape(len(bins) * T, -1)[index.reshape(-1)].view(B, T, -1)


def shared_prefix_plan(tokens: torch.Tensor, attention_mask: torch.Tensor, prefix_len: torch.Tensor,
                       min_saving: float = 0.1):
    """Rows that begin with the same prefix (a GRPO group's prompt), for a forward pass that runs each distinct
    prefix once. Returns (first, owner) or None when the rows are not right-padded or sharing would save less
    than `min_saving` of the real tokens: first [P] the first row of each distinct prefix, owner [B] which of
    them each row's prefix is (its index into `first`)."""
    B, T = tokens.shape
    lens = attention_mask.sum(1)
    if B < 2 or not right_padded(attention_mask):
        return None
    plen = prefix_len.clamp(min=0).minimum(lens)
    if not bool((plen >= 1).all()):
        return None
    rows = tokens.tolist()
    seen: dict[tuple, int] = {}
    first: list[int] = []
    owner: list[int] = []
    for r, n in enumerate(plen.tolist()):
        key = tuple(rows[r][:n])
        if key not in seen:
            seen[key] = len(first)
            first.append(r)
        owner.append(seen[key])
    saved = int(plen.sum()) - int(plen[first].sum())
    if saved < min_saving * max(int(lens.sum()), 1):
        return None
    dev = tokens.device
    return torch.tensor(first, device=dev), torch.tensor(owner, device=dev)


def _shareable(model) -> bool:
    """Models whose forward can continue from a copied past (`shared_prefix_logits`): transformers' own
    attention (`_packable`), every layer full attention (a plain DynamicCache), no gradient checkpointing
    (which turns the cache off in training), float32 without autocast: in bf16 the copied past rounds
    differently from one full pass (3.9e-3 on a real OpenRLHF job's step loss, beyond the cross-backend
    tolerance), so reduced precision keeps the one pass OpenRLHF's actor makes."""
    if not _packable(model):
        return False
    inner = unwrapped(model)
    param = next(inner.parameters(), None)
    if param is None or param.dtype != torch.float32 or torch.is_autocast_enabled(param.device.type):
        return False
    if checkpointing(inner):
        return False
    cfg = inner.config
    return full_attention(getattr(cfg, "text_config", None) or cfg)


def _cache_argument(model) -> str:
    """The forward's name for a past cache: `cache` (transformers >= 5.2x) or `past_key_values` (before)."""
    import inspect

    inner = unwrapped(model)
    return "cache" if "cache" in inspect.signature(type(inner).forward).parameters else "past_key_values"


def _output_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def shared_prefix_logits(model, tokens: torch.Tensor, attention_mask: torch.Tensor, prefix_len: torch.Tensor,
                         plan=None):
    """The model's logits [B, T, V] of right-padded rows whose first `prefix_len[b]` tokens repeat across rows
    (a group's prompt): each distinct prefix runs once, its keys and values are copied to the rows that share
    it, and each row's remaining tokens run with that past (positions continuing after its prefix). Real
    positions get the padded forward's logits up to float rounding; gradients through a shared prefix flow
    once, summed over its rows (the same sum the padded forward's copies make). Pad positions get their row's
    last real position's logits. None when the plan does not apply (`shared_prefix_plan`)."""
    from transformers import DynamicCache

    plan = plan or shared_prefix_plan(tokens, attention_mask, prefix_len)
    if plan is None:
        return None
    first, owner = plan
    B, T = tokens.shape
    dev = tokens.device
    lens = attention_mask.sum(1)
    plen = prefix_len.clamp(min=0).minimum(lens)
    P, Lp = first.numel(), int(plen.max())
    t = torch.arange(T, device=dev)
    # the distinct prefixes, right-padded to Lp (pads follow every real token: causal attention never sees them)
    ptok = tokens[first, :Lp]
    pl = plen[first]
    ptok = ptok.masked_fill(t[None, :Lp] >= pl[:, None], 0)
    out = model(input_ids=ptok, use_cache=True)
    plogits, past = out.logits, _output_cache(out)  # [P, Lp, V]
    if past is None:  # the model kept no cache after all
        return None
    # each row's rest: tokens plen..lens-1, right-padded to R, positions plen + j, attending to its prefix's
    # real slots of the cache and to itself causally
    rlen = lens - plen
    R = max(int(rlen.max()), 1)
    j = torch.arange(R, device=dev)
    src = (plen[:, None] + j[None]).clamp(max=T - 1)
    rtok = tokens.gather(1, src).masked_fill(j[None] >= rlen[:, None], 0)
    pos = plen[:, None] + j[None]  # [B, R]
    mask = torch.cat([t[None, :Lp] < plen[:, None], torch.ones((B, R), dtype=torch.bool, device=dev)], dim=1)
    layers = getattr(past, "layers", None)
    kv = [(layer.keys, layer.values) for layer in layers] if layers is not None else list(past)
    cache = DynamicCache(ddp_cache_data=[(k.index_select(0, owner), v.index_select(0, owner)) for k, v in kv])
    rlogits = model(input_ids=rtok, attention_mask=mask.long(), position_ids=pos, use_cache=True,
                    **{_cache_argument(model): cache}).logits  # [B, R, V]
    # position t of row b: its prefix's logits (t < plen), else its rest's (t - plen), pads: the last real one
    V = plogits.shape[-1]
    last = (lens.clamp(min=1) - 1)[:, None]
    tt = torch.minimum(t[None], last)  # [B, T]
    in_prefix = tt < plen[:, None]
    idx = torch.where(in_prefix, owner[:, None] * Lp + tt.clamp(max=Lp - 1),
                      P * Lp + torch.arange(B, device=dev)[:, None] * R + (tt - plen[:, None]).clamp(min=0, max=R - 1))
    flat = torch.cat([plogits.reshape(P * Lp, V), rlogits.reshape(B * R, V)])
    return flat[idx.reshape(-1)].view(B, T, V)


def token_logprobs(model, tokens: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
                   want_logits: bool = False, prefix_len: torch.Tensor | None = None,
                   read: torch.Tensor | None = None):
    """One forward pass: per-token log-probs aligned with `tokens` (and the predicting logits if wanted).

    tokens, attention_mask: [B, T]. Returns logprobs [B, T] (0 at t=0), logits [B, T, V] or None,
    entropy [B, T]. With `prefix_len` [B] (each row's prompt length), rows that share a prompt run it once
    (`shared_prefix_logits`) when that saves tokens; otherwise right-padded rows are packed padding-free when
    that saves tokens (`packed_logits`). With `read` [B, T] bool (the positions whose log-prob, entropy or
    logits the caller reads), the forward may skip work the other positions alone need (`varlen.logits`):
    their log-probs and entropies are then 0 and their logits zeros.
    """
    mask = attention_mask.bool()
    logits = None
    if prefix_len is not None and _shareable(model):
        logits = shared_prefix_logits(model, tokens, mask, prefix_len.to(tokens.device))
    if logits is None:
        # log-prob t comes from the logits at t - 1
        ahead = None if read is None else torch.cat([read[:, 1:], read.new_zeros(read.shape[0], 1)], dim=1).bool()
        logits = packed_logits(model, tokens, mask, ahead)
    logits = logits[:, :-1].float()  # [B, T-1, V]
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    lp = logp_all.gather(-1, tokens[:, 1:, None]).squeeze(-1)  # [B, T-1]
    ent = -(logp_all.exp() * logp_all).sum(-1)  # [B, T-1]
    pad = lp.new_zeros(tokens.shape[0], 1)
    logprobs = torch.cat([pad, lp], dim=1)
    entropy = torch.cat([pad, ent], dim=1)
    if read is not None:  # the same values whichever path ran: 0 where nobody reads
        unread = ~read.bool()
        logprobs, entropy = logprobs.masked_fill(unread, 0.0), entropy.masked_fill(unread, 0.0)
    full = None
    if want_logits:
        full = torch.cat([logits.new_zeros(tokens.shape[0], 1, logits.shape[-1]), logits], dim=1)  # [B, T, V]
    return logprobs, full, entropy


# ---------------------------------------------------------------------------------------- scalar heads
# A critic (ppo.critic) and a reward model (reward_model sources) are transformers *ForSequenceClassification models
# with one output: a backbone (`base_model_prefix`) and a linear head `score` (Llama, Qwen, Mistral, GPT-2), the
# layout OpenRLHF's get_llm_for_sequence_regression loads and saves (value_head_prefix "score").

def score_head(model) -> torch.nn.Module:
    """The scalar head of a sequence-regression model (`score`), or ModelLoadError."""
    head = getattr(model, "score", None)
    if not isinstance(head, torch.nn.Linear) or head.out_features != 1:
        raise ModelLoadError(f"{type(model).__name__}: a value or reward model needs one output from a linear head "
                             "named `score` (a *ForSequenceClassification with num_labels 1)")
    return head


def backbone(model) -> torch.nn.Module:
    """The transformer under a causal LM's or a sequence-regression model's head (`base_model_prefix`)."""
    inner = unwrapped(model)
    return getattr(inner, inner.base_model_prefix)


def last_hidden(model, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T, H] the last hidden state of the model's backbone on right-padded rows (causal: position t sees :t+1)."""
    return backbone(model)(input_ids=tokens, attention_mask=attention_mask.long()).last_hidden_state


def token_scores(model, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] the scalar head of a sequence-regression model at every position (a reward model reads the last real
    one, a critic each action's state)."""
    return score_head(model)(last_hidden(model, tokens, attention_mask)).squeeze(-1)


def seeded_head(hidden: int, std: float, seed: int, dtype=torch.float32) -> torch.nn.Linear:
    """A fresh Linear(hidden, 1, bias=False), weights N(0, std^2) from a generator of its own (`seed`): building a
    critic never moves the run's global random state, so a resumed run draws what an uninterrupted one draws."""
    with torch.random.fork_rng(devices=[]):  # nn.Linear's own init draws from the global generator
        head = torch.nn.Linear(hidden, 1, bias=False, dtype=dtype)
    g = torch.Generator().manual_seed(int(seed) + 7919)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g, dtype=torch.float32) * std)
    return head


def _init_std(config) -> float:
    return float(getattr(config, "initializer_range", 0.02) or 0.02)


def value_model_from(policy, seed: int) -> torch.nn.Module:
    """A critic initialised from the policy's weights: a *ForSequenceClassification (num_labels 1) of the policy's
    architecture, its backbone a copy of the policy's (a LoRA policy: merged), its `score` head fresh (`seeded_head`),
    as OpenRLHF starts its critic from the actor's checkpoint with a new value head."""
    from transformers import AutoModelForSequenceClassification

    source = merged(unwrapped(policy)) if has_adapter(policy) else unwrapped(policy)
    import copy

    config = copy.deepcopy(source.config)
    config.num_labels = 1
    dtype = next(source.parameters()).dtype
    with torch.random.fork_rng(devices=[]):  # the throw-away random init draws from a forked generator
        try:
            net = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"the policy ({type(source).__name__}) has no sequence-regression form for a critic "
                                 f"({type(e).__name__}: {str(e).splitlines()[0][:160]}); give ppo.critic.model a value "
                                 "model checkpoint") from None
    backbone(net).load_state_dict(backbone(source).state_dict())
    net.score = seeded_head(config.hidden_size, _init_std(config), seed, dtype)
    net.config.pad_token_id = config.pad_token_id
    from composer.runtime.onednn import use_onednn

    return use_onednn(net)


def _load_regression(name: str, what: str, dtype: str, trust_remote_code: bool, **kwargs):
    """(model, loading info) of a *ForSequenceClassification checkpoint at `name` (resolved), loaded under a forked
    RNG with transformers' load report silenced (a missing `score` head is the caller's to judge); ModelLoadError
    naming `what` when it does not load."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    path = resolve(name)
    if not Path(path).exists():
        from composer.runtime.paths import model_problem

        why = model_problem(path, tokenizer_too=False)
        if why:
            raise ModelLoadError(why)
    trust = _trusted(trust_remote_code, path, what)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with torch.random.fork_rng(devices=[]):
            return AutoModelForSequenceClassification.from_pretrained(
                path, dtype=getattr(torch, dtype), trust_remote_code=trust,
                output_loading_info=True, **kwargs)
    except Exception as e:
        raise _load_error(what, path, e) from None
    finally:
        hf_logging.set_verbosity(verbosity)


def _missing_head(info: dict) -> bool:
    return any(k.split(".")[0] == "score" for k in info.get("missing_keys", ()))


def load_value_model(name: str, dtype: str = "float32", trust_remote_code: bool = False,
                     seed: int = 0) -> torch.nn.Module:
    """A sequence-regression model with one output from `name` (resolved): a *ForSequenceClassification checkpoint
    keeps its head; a causal LM's gets a fresh `score` head (`seeded_head`). ModelLoadError when it does not load."""
    net, info = _load_regression(name, "value model", dtype, trust_remote_code, num_labels=1)
    head = score_head(net)
    if _missing_head(info):  # a causal LM: a fresh head
        net.score = seeded_head(head.in_features, _init_std(net.config), seed, head.weight.dtype)
    from composer.runtime.onednn import use_onednn

    return use_onednn(net)


def policy_head(policy, seed: int) -> torch.nn.Linear:
    """A fresh scalar head over the policy's hidden size (ppo critic.network: shared)."""
    config = unwrapped(policy).config
    config = getattr(config, "text_config", None) or config
    return seeded_head(config.hidden_size, _init_std(config), seed, next(policy.parameters()).dtype)


def load_scorer(name: str, dtype: str = "float32", trust_remote_code: bool = False) -> torch.nn.Module:
    """A trained sequence-regression model (a reward model) from `name`: a *ForSequenceClassification checkpoint
    with one output and its `score` head; ModelLoadError when it does not load, has another number of outputs, or
    has no trained head (a causal LM would score with random weights)."""
    path = resolve(name)
    net, info = _load_regression(name, "reward model", dtype, trust_remote_code)
    if getattr(net.config, "num_labels", 1) != 1:
        raise ModelLoadError(f"reward model at {path}: {net.config.num_labels} outputs (num_labels); a reward model "
                             "scores with one")
    score_head(net)
    if _missing_head(info):
        raise ModelLoadError(f"reward model at {path}: the checkpoint has no trained `score` head (a causal LM?); "
                             "a reward model is a *ForSequenceClassification with one output")
    from composer.runtime.onednn import use_onednn

    return use_onednn(net)


def policy_view(policy, batch, want_logits: bool = False, read: torch.Tensor | None = None):
    """The PolicyView of `batch` under `policy` (one forward at the batch's temperature): log-probs, entropies, and
    logits if wanted; with `read` [B, T] bool, promised at those positions only (`token_logprobs`). The Lightning
    backend's `forward` of the step's loss (composer/step.py)."""
    from composer.batch import PolicyView

    lp, logits, ent = token_logprobs(policy, batch.tokens, batch.attention_mask, batch.info.get("temperature", 1.0),
                                     want_logits, prefix_len=batch.prompt_len, read=read)
    return PolicyView(lp, logits, ent)


@torch.no_grad()
def batch_entropy(model, batch) -> torch.Tensor:
    """[B, T] the entropy of `model`'s full next-token distribution at each position of the batch (0 at t = 0), at the
    batch's temperature, no gradient, on the batch's device (the old policy's H_t of an entropy token selection)."""
    device = next(model.parameters()).device
    _, _, ent = token_logprobs(model, batch.tokens.to(device), batch.attention_mask.to(device),
                               batch.info.get("temperature", 1.0), prefix_len=batch.prompt_len.to(device))
    return ent.to(batch.tokens.device)


@torch.no_grad()
def batch_logprobs(model, batch) -> torch.Tensor:
    """[B, T] log-probs of the batch's tokens under `model` (frozen weights: the initial policy), on the batch's
    device."""
    device = next(model.parameters()).device
    lp, _, _ = token_logprobs(model, batch.tokens.to(device), batch.attention_mask.to(device),
                              batch.info.get("temperature", 1.0), prefix_len=batch.prompt_len.to(device))
    return lp.to(batch.tokens.device)
