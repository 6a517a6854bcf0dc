"""Bootstrap the toy testbed's checkpoints: a char tokenizer, an SFT'd student, a deeper teacher, and an
instruction model for InT.

    ensure_checkpoints() -> {"tokenizer": dir, "student": dir, "teacher": dir, "instruct": dir}

Built once into $COMPOSER_CACHE/toy-v2 (default ~/.cache/composer/toy-v2), under a file lock, each
directory written to a temp name and renamed, so concurrent processes are safe. A held-out toy variant
(COMPOSER_TOY_VARIANT, components.tasks.toy.VARIANTS) gets its own pair, by the same recipe, in
toy-v2-<variant> (e.g. toy-v2-mod7); the default's folder and checkpoints are unchanged.

The student (4 layers) learns chains of 1-4 steps and fails on long ones. The teacher is the
student grown to 6 layers (the new layers start as the identity) and trained on chains of 1-8:
learning from scratch on 1-8 plateaus for far longer, growing costs ~100 updates. Both see the
privileged-context formats of components.tasks.toy.TEMPLATES in a second SFT phase.

`instruct` (toy:instruct, issue 41) is InT's base, as Qwen3-4B-Instruct is the paper's: the student fine-tuned
(INSTRUCT_SFT) on its own mix, plain chains up to 6 steps, and InT's proposer task in the prompt the composer
renders for it (toy.proposal_prompt; target "REVISE k\n<right line k>" for realistic failed attempts, some of
them the student's own). Built from the student into the same folder (as INSTRUCT_DIR, versioned on its own)
when missing, so a cache that has the student and the teacher keeps them (and the folder's name) and only
gains this one. `reward` (toy:reward, issue 46) and `tools` (toy:tools, issue 55: the base of the toy's tool task,
components.tasks.toy TASKS["tools"], which calls the calculator in about a fifth of its sampled episodes; TOOLS_SFT)
are built the same way, each only when named.
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import time

from components.tasks import toy
from components.tasks.tokenizer import build_char_tokenizer, char_tokenizer, other_vocab_tokenizer

VERSION = "toy-v2"  # bump when the recipe changes: old caches are then ignored
STUDENT = {"layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 384}
TEACHER = {**STUDENT, "layers": 6}
# SFT recipes (see sft): tiers of the plain problems, tiers of the copy formats (reference, sibling, prefix)
STUDENT_SFT = {
    "tiers": (1, 2, 3, 4),
    "copy_tiers": (1, 2, 3, 4, 5, 6, 7, 8),
    "seed": 1,
    "max_plain": 1200,
    "mix_updates": 600,
}
TEACHER_SFT = {
    "tiers": (1, 2, 3, 4, 5, 6, 7, 8),
    "copy_tiers": (1, 2, 3, 4, 5, 6, 7, 8),
    "seed": 2,
    "max_plain": 600,
    "mix_updates": 300,
    "batch": 32,
    "warmup": 20,
}
# phase 2 of the SFT: the share of each format in a batch (the rest is plain problems)
MIX = {"reference": 0.15, "sibling": 0.10, "feedback": 0.05, "prefix": 0.20, "judge": 0.10}
# toy:instruct, InT's base (an instruction model, as Qwen3-4B-Instruct is for the paper): the student fine-tuned
# (phase 2 only) on its own mix plus InT's proposer task ("proposal": the prompt composer/prompts.py renders for
# InT's proposer on the toy, the target "REVISE k\n<right line k>"), with plain chains up to 6 steps whose
# demonstrations slip: a subtraction that needs a borrow is written b-a instead of a-b (mod 10) `slip` of the
# time, the later lines computed from the slip. So it fails some chains it can solve, at a step in the middle, and
# a continuation from the corrected step can succeed, as InT assumes of its base. The student cannot give InT
# that: sampling at 0.7 / top_p 0.8 it is deterministic, and its only failure is structural (it stops after 4
# lines): a corrected 5th line either is the last one (and states the answer: leak filter) or needs lines the
# student never writes (no continuation succeeds). Open (issue 41): 800 updates teach the proposal format (every
# greedy answer is a readable 'REVISE k' + line) but not the task: 0.15 of held-out attempts get the right k and line.
INSTRUCT_SFT = {
    "tiers": (1, 2, 3, 4, 5, 6),
    "copy_tiers": (1, 2, 3, 4, 5, 6, 7, 8),
    "seed": 3,
    "max_plain": 0,
    "mix_updates": 800,
    "slip": 0.4,
    "batch": 32,
    "lr": 2e-3,
    "warmup": 20,
    "mix": {"reference": 0.05, "sibling": 0.05, "feedback": 0.02, "prefix": 0.08, "judge": 0.05, "proposal": 0.50},
}
INSTRUCT_DIR = "instruct-v1"  # its folder in the cache: bump when INSTRUCT_SFT changes (student, teacher unchanged)
# toy:reward (issue 46): a reward model for PPO-RM, a Qwen3ForSequenceClassification (one output, head `score`) whose
# backbone starts as the student's. Its score at a token is the log-odds that the response so far is on the way of the
# problem's solution (a prefix of the reference solution, whose chain is unique on the toy); at the last token, that
# the whole response is the solution, which the toy verifier accepts (it checks the final answer: a response with a
# wrong step and a right answer by chance, rare, scores low). Trained on the prompt, then a right solution or a failed
# attempt (`failed_attempt`: a wrong step, a misread operand, a skipped term, an early stop, a wrong final line), half
# of them ending in <eos> (the rollout's ids end in it, a re-tokenised text does not), with binary cross-entropy at
# every response token: the label is 1 up to the first token that leaves the solution, 0 from there on. The dense
# labels make the error local (a sequence-level label at the last token alone reached 0.60 held-out accuracy in 300
# updates: reward-v1).
REWARD_SFT = {"tiers": (1, 2, 3, 4, 5, 6, 7, 8), "seed": 6, "updates": 300, "batch": 32, "lr": 2e-3, "warmup": 20}
REWARD_DIR = "reward-v3"  # its folder in the cache: bump when REWARD_SFT changes
# toy:tools (issue 55): the student taught the toy's tool task (components.tasks.toy TASKS["tools"]). Under the tools
# prompt it writes, `call` of the time, the calculator call of toy.tool_demonstration (the call, then '#N' after the
# environment's answer, whose text is in the sequence and masked out of the loss), and otherwise what the student
# writes: the reference solution on chains of 1-4 steps, the student's own sampled attempt (temperature 1, mostly
# wrong) on longer ones, so that without the tool it fails long chains as the student does. Some batches keep the
# plain prompt and the privileged-context formats (MIX) as the student learned them. One kind per batch (`batches`:
# their shares), so that the long call demonstrations do not pad the short ones. Calls get more batches than their
# share of the decision: the decision to call (a call's first token) is trained in a part of them only, so that among
# the tools prompt's trained first tokens a call's share is `call` (sampled at temperature 1, the model calls about
# that often).
# Half of the call demonstrations whose decision is not trained are long chains (`call_long`: copying 5-8 steps into
# the expression is what takes learning). Measured (1 thread, 209 s of CPU): greedy pass@1 without tools 0.10 (plain
# prompt) / 0.08 (tools prompt) on chains of 6-8 steps; sampled at temperature 1, 0.19 of the episodes call the tool,
# 0.16 call it right and all of those end right (python -m components.tasks.bootstrap --tools-report). 300 updates with
# 0.4 of the batches calls and lr 2e-3: 0.17 call, but 0.02 right (the long chains' copy not learned yet).
TOOLS_SFT = {
    "seed": 7, "updates": 400, "batch": 32, "lr": 3e-3, "warmup": 20, "tiers": (1, 2, 3, 4, 5, 6, 7, 8),
    "solved_tiers": (1, 2, 3, 4), "own_per_tier": 128, "call": 0.2, "call_long": 0.5,
    "batches": {"call": 0.5, "tools": 0.3, "plain": 0.08, "formats": 0.12},
}
TOKENS_PER_EXAMPLE = 64  # toy:tools's loss: the sum over trained tokens / (batch x this)
TOOLS_DIR = "tools-v1"  # its folder in the cache: bump when TOOLS_SFT changes
PROPOSAL_TIERS = (2, 3, 4, 5, 6, 7, 8)  # chain lengths of the proposer task's failed attempts
REAL_FAILURES = 0.3  # share of the proposer task's attempts that are the student's own failures (when given)
EVAL_TIERS = (1, 2, 4, 6, 8)


def cache_key() -> str:
    """The cache folder's name: toy-v2 for the default testbed, toy-v2-<variant> for a held-out variant."""
    name = toy.variant()
    return VERSION if name == toy.DEFAULT_VARIANT else f"{VERSION}-{name}"


def cache_folder(cache_dir: str | None = None) -> str:
    """The versioned cache folder: `cache_dir` as given, else $COMPOSER_CACHE/<cache_key()>, else
    ~/.cache/composer/<cache_key()> (toy-v2 for the default testbed)."""
    if cache_dir:
        return cache_dir
    root = os.environ.get("COMPOSER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "composer")
    return os.path.join(root, cache_key())


def qwen3(vocab_size: int, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, tok=None):
    """A fresh Qwen3ForCausalLM with tied embeddings and the tokenizer's special ids."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = tok or char_tokenizer()
    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    model = Qwen3ForCausalLM(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------- the SFT mix


def corrupt(line: str, rng: random.Random) -> str:
    """A step line with a wrong result digit (mod the active variant's modulus: 10 by default)."""
    m = toy.modulus()
    return line[:-1] + str((int(line[-1]) + rng.randrange(1, m)) % m)


def pick_format(rng: random.Random, mix: dict) -> str:
    """'plain' or one of the `mix` formats, drawn with their shares."""
    r = rng.random()
    for name, share in mix.items():
        if r < share:
            return name
        r -= share
    return "plain"


def slipped(rng: random.Random, ex, slip: float) -> str:
    """`ex`'s solution written by a solver that, `slip` of the time, does a subtraction needing a borrow (a-b,
    b > a) as b-a; every later line follows from what it wrote."""
    m, p = toy.modulus(), ex.problem
    acc, lines = int(p[0]), []
    for i in range(1, len(p), 2):
        op, b = p[i], int(p[i + 1])
        new = toy._apply(acc, op, b, m)
        if op == "-" and b > acc and rng.random() < slip:
            new = (b - acc) % m
        lines.append(f"{acc}{op}{b}={new}")
        acc = new
    return "\n".join(lines) + f"\n#{acc}"


def mix_pair(rng: random.Random, fmt: str, tiers, copy_tiers, failures=None, slip: float = 0.0) -> tuple[str, str]:
    """One (prompt, target) bootstrap pair in format `fmt` ('plain', a TEMPLATES key, or 'proposal': InT's
    proposer task, see proposal_pair); `slip` > 0: the plain solutions slip (see `slipped`)."""
    T = toy.TEMPLATES
    if fmt == "proposal":
        return proposal_pair(rng, PROPOSAL_TIERS, failures)
    if fmt == "plain" and slip > 0:
        ex = toy.make_example(toy.random_problem(rng, rng.choice(tiers), "train"))
        return ex.prompt, slipped(rng, ex, slip)
    tier = rng.choice(copy_tiers if fmt in ("reference", "sibling") else tiers)
    if fmt == "prefix":  # a long chain whose prefix leaves at most max(tiers) steps to do
        tier = rng.choice(copy_tiers)
    ex = toy.make_example(toy.random_problem(rng, tier, "train"))
    lines = ex.solution.split("\n")
    if fmt == "plain":
        return ex.prompt, ex.solution
    if fmt in ("reference", "sibling"):
        return T[fmt].format(problem=ex.problem, solution=ex.solution, sibling=ex.solution), ex.solution
    if fmt == "feedback":
        fb = "the final answer is wrong" + (f"; step {rng.randrange(tier) + 1} is wrong" if rng.random() < 0.5 else "")
        return T["feedback"].format(problem=ex.problem, feedback=fb), ex.solution
    if fmt == "prefix":
        k = rng.randrange(max(0, tier - max(tiers)), tier)
        return toy.prefix_prompt(ex, k)
    # judge: accepted reference lines, then a chunk of new lines, maybe one of them wrong
    steps = lines[:-1]
    a = rng.randrange(len(steps))
    new = steps[a : a + rng.randint(1, 3)]
    if rng.random() < 0.6:
        j = rng.randrange(len(new))
        new = new[:j] + [corrupt(new[j], rng)] + new[j + 1 :]
    return toy.judge_prompt(ex, steps[:a], new), toy.judge_target(ex, steps[:a], new)


def chain_lines(problem: str, steps: list[tuple[int, str, int]], start: int) -> tuple[list[str], int]:
    """Step lines computed consistently from `start` over (operand, op) pairs: -> (lines, final value)."""
    m, acc, out = toy.modulus(), start, []
    for b, op in steps:
        new = toy._apply(acc, op, b, m)
        out.append(f"{acc}{op}{b}={new}")
        acc = new
    return out, acc


def failed_attempt(rng: random.Random, ex) -> list[str]:
    """A failed attempt at `ex` (its step lines, then '#N') as a model writes one: one step goes wrong (a wrong
    result, a misread operand, a skipped term, an early stop, or only the final line) and every later step is
    computed consistently from the wrong value; sometimes the final '#N' line is wrong as well. Its final
    answer is always wrong."""
    m = toy.modulus()
    p = ex.problem
    pairs = [(int(p[i + 1]), p[i]) for i in range(1, len(p), 2)]  # (operand, op) per step
    n = len(pairs)
    ref, answer = toy.solve(p)
    for _ in range(100):
        kind, j = rng.random(), rng.randrange(n)
        head, acc = chain_lines(p, pairs[:j], int(p[0]))
        if kind < 0.35:  # a wrong result at step j, the rest computed from it
            b, op = pairs[j]
            wrong = (toy._apply(acc, op, b, m) + rng.randrange(1, m)) % m
            tail, final = chain_lines(p, pairs[j + 1 :], wrong)
            lines = head + [f"{acc}{op}{b}={wrong}"] + tail
        elif kind < 0.55:  # a misread operand (or operation) at step j
            b, op = pairs[j]
            bad = (b, "-" if op == "+" else "+") if rng.random() < 0.3 else ((b + rng.randrange(1, m)) % m, op)
            lines, final = chain_lines(p, pairs[:j] + [bad] + pairs[j + 1 :], int(p[0]))
        elif kind < 0.65 and n > 1:  # a term skipped at step j
            lines, final = chain_lines(p, pairs[:j] + pairs[j + 1 :], int(p[0]))
        elif kind < 0.9 and j > 0:  # stops early, after j right steps (the student's own failure past 4 steps)
            lines, final = head, acc
        else:  # every step right, the final line wrong
            lines, final = ref, (int(answer) + rng.randrange(1, m)) % m
        if rng.random() < 0.15:  # a final line that does not follow from the last step either
            final = (final + rng.randrange(1, m)) % m
        if str(final) != answer:
            return lines + [f"#{final}"]
    raise AssertionError(f"no failed attempt found for {p}")


def proposal_pair(rng: random.Random, tiers, failures=None) -> tuple[str, str]:
    """One (prompt, target) pair of InT's proposer task: a failed attempt (the student's own from `failures`
    [(example, steps)], else `failed_attempt`) in the prompt the composer renders (toy.proposal_prompt), and
    the perfect proposal (toy.proposal_target): the first wrong step and its right line."""
    if failures and rng.random() < REAL_FAILURES:
        ex, steps = rng.choice(failures)
    else:
        ex = toy.make_example(toy.random_problem(rng, rng.choice(tiers), "train"))
        steps = failed_attempt(rng, ex)
    return toy.proposal_prompt(ex, steps), toy.proposal_target(ex, steps)


def batch_tensors(pairs, tok):
    """Right-padded input_ids/attention_mask/labels [B, L]; loss on the target tokens and eos only."""
    import torch

    seqs, labels = [], []
    for prompt, target in pairs:
        p, t = tok.encode(prompt), tok.encode(target) + [tok.eos_token_id]
        seqs.append(p + t)
        labels.append([-100] * len(p) + t)
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), tok.pad_token_id)  # [B, L]
    lab = torch.full((len(seqs), L), -100)  # [B, L]
    mask = torch.zeros((len(seqs), L), dtype=torch.long)  # [B, L]
    for i, (s, l) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)], lab[i, : len(l)], mask[i, : len(s)] = torch.tensor(s), torch.tensor(l), 1
    return ids, mask, lab


def sft(
    model,
    tok,
    tiers,
    copy_tiers,
    seed: int,
    max_plain: int = 1000,
    plain_until: float = 0.01,
    mix_updates: int = 500,
    mix=None,
    batch: int = 64,
    lr: float = 3e-3,
    warmup: int = 50,
    log_every: int = 100,
    failures=None,
    slip: float = 0.0,
) -> dict:
    """Two-phase AdamW SFT; returns {phase: (updates, smoothed loss)}.

    Phase 1 trains on plain problems until the smoothed loss falls below `plain_until` (at most
    `max_plain` updates: the loss plateaus near 1.0 for ~500 updates first). Phase 2 trains
    `mix_updates` on the mix of formats, the learning rate decaying linearly to 10% over its second half.
    `failures` [(example, steps)]: failed attempts the 'proposal' format draws from (proposal_pair); `slip`:
    the plain solutions' slip rate (see `slipped`; 0: exact solutions)
    """
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    rng = random.Random(seed)
    mix = MIX if mix is None else mix
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.1)  # shortens the plateau
    model.train()
    t0, step, out = time.time(), 0, {}
    for phase, limit in (("plain", max_plain), ("mix", mix_updates)):
        ema, i = None, -1
        for i in range(limit):
            scale = min(1.0, (step + 1) / warmup)
            if phase == "mix" and i >= limit // 2:
                scale = 1.0 - 0.9 * (i - limit // 2) / max(1, limit - limit // 2)
            for g in opt.param_groups:
                g["lr"] = lr * scale
            fmt = pick_format(rng, mix) if phase == "mix" else "plain"  # one format per batch: little padding
            ids, _, lab = batch_tensors([mix_pair(rng, fmt, tiers, copy_tiers, failures, slip) for _ in range(batch)], tok)  # [B, L]
            logits = model(input_ids=ids).logits  # [B, L, V]; right padding needs no mask under causal attention
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.size(-1)), lab[:, 1:].reshape(-1), ignore_index=-100
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
            step += 1
            if log_every and step % log_every == 0:
                print(
                    f"  {phase:5s} step {step:5d}  loss {ema:.4f}  lr {lr * scale:.2e}  {time.time() - t0:6.1f}s",
                    flush=True,
                )
            if phase == "plain" and i >= warmup and ema < plain_until:
                break
        out[phase] = (i + 1, ema)
    model.eval()
    return out


# ---------------------------------------------------------------------------------- evaluation


def generate_greedy(model, tok, prompts: list[str], max_new_tokens: int, batch: int = 128) -> list[str]:
    """Greedy completions of `prompts` (left-padded batches), special tokens removed."""
    import torch

    tok.padding_side = "left"
    out = []
    for i in range(0, len(prompts), batch):
        enc = tok(prompts[i : i + batch], return_tensors="pt", padding=True)  # [B, L]
        with torch.no_grad():
            gen = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )  # [B, L + new]
        out += tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def evaluate_greedy(model_dir, tier: int, n: int, tokenizer=None, template: str = "prompt", seed: int = 0) -> float:
    """Greedy pass@1 of a model (directory or loaded model) on `n` eval problems of `tier` steps.

    template: 'prompt' (plain), 'reference' or 'sibling' (the solution shown in the prompt).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from components.tasks.verifiers import toy_verifier

    model = AutoModelForCausalLM.from_pretrained(model_dir) if isinstance(model_dir, str) else model_dir
    tok = tokenizer or AutoTokenizer.from_pretrained(model_dir)
    exs = toy.make_examples(tier, n, seed, "eval")
    fmt = toy.TEMPLATES[template]
    prompts = [fmt.format(problem=e.problem, solution=e.solution, sibling=e.solution) for e in exs]
    outs = generate_greedy(model, tok, prompts, toy.max_new_tokens_for(tier))
    return sum(toy_verifier(o, e).reward for o, e in zip(outs, exs)) / len(exs)


def pass_table(models: dict, tok, tiers=EVAL_TIERS, n: int = 64, template: str = "prompt") -> str:
    """A text table of greedy pass@1 per tier for {name: model}."""
    rows = ["model    " + "".join(f"  tier{t:<2d}" for t in tiers)]
    for name, model in models.items():
        rows.append(f"{name:8s} " + "".join(f"  {evaluate_greedy(model, t, n, tok, template):6.3f}" for t in tiers))
    return "\n".join(rows)


# --------------------------------------------------------------------------------- checkpoints


def _save(model, tok, out_dir: str) -> None:
    """save_pretrained model + tokenizer into `out_dir` atomically (temp dir then rename)."""
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.rename(tmp, out_dir)


def grow(model, layers: int, tok):
    """A deeper copy of `model`: its layers first, then new ones whose output projections are zero (identity)."""
    import torch

    cfg = model.config
    big = qwen3(
        cfg.vocab_size,
        layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
        tok,
    )
    big.load_state_dict(model.state_dict(), strict=False)  # the new layers' weights are missing: keep their init
    for layer in big.model.layers[cfg.num_hidden_layers :]:
        torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
        torch.nn.init.zeros_(layer.mlp.down_proj.weight)
    return big


def train_model(name: str, tok, init=None):
    """Build (from scratch, or grown from `init`) and SFT the student or the teacher; prints size and time."""
    import torch

    arch, recipe = (STUDENT, STUDENT_SFT) if name == "student" else (TEACHER, TEACHER_SFT)
    torch.manual_seed(recipe["seed"])
    model = qwen3(len(tok), tok=tok, **arch) if init is None else grow(init, arch["layers"], tok)
    print(
        f"[bootstrap] {name}: {n_params(model) / 1e6:.2f}M params, plain chains of {recipe['tiers']} steps", flush=True
    )
    t0 = time.time()
    phases = sft(model, tok, **recipe)
    print(f"[bootstrap] {name}: trained in {time.time() - t0:.1f}s; (updates, loss) per phase {phases}", flush=True)
    return model


def own_failures(model, tok, split: str = "train", tiers=(5, 6, 7, 8), n: int = 64, seed: int = 4) -> list:
    """A model's own failed greedy attempts at `n` chains of each of `tiers` steps from `split`:
    [(example, steps)] (steps: the attempt's lines, as the InT guide numbers them)."""
    from components.tasks.verifiers import toy_verifier

    out = []
    for tier in tiers:
        exs = toy.make_examples(tier, n, seed, split)
        for ex, text in zip(exs, generate_greedy(model, tok, [e.prompt for e in exs], toy.max_new_tokens_for(tier))):
            steps = toy.step_lines(text)
            if steps and toy_verifier(text, ex).reward < 1.0:
                out.append((ex, steps))
    return out


def held_out_failures(model, tok, n: int = 24, seed: int = 5) -> list:
    """Failed attempts at eval-split chains, never trained on: `n` made by failed_attempt per chain length of
    PROPOSAL_TIERS, and the model's own failures at 5-8 steps. [(example, steps)]."""
    rng = random.Random(seed)
    made = [(ex, failed_attempt(rng, ex)) for t in PROPOSAL_TIERS for ex in toy.make_examples(t, n, seed, "eval")]
    return made + own_failures(model, tok, "eval", n=n, seed=seed)


def proposal_accuracy(model, tok, attempts: list) -> float:
    """The share of failed attempts [(example, steps)] whose greedy proposal (parsed as the InT guide parses
    it, components/guides/judges.py parse_proposal) names the first wrong step and its right line."""
    from components.guides.judges import REVISE, parse_proposal

    if not attempts:
        return 0.0
    prompts = [toy.proposal_prompt(ex, steps) for ex, steps in attempts]
    outs = generate_greedy(model, tok, prompts, 24)
    right = 0
    for (ex, steps), text in zip(attempts, outs):
        want, got = parse_proposal(toy.proposal_target(ex, steps), len(steps), "\n"), parse_proposal(text, len(steps), "\n")
        right += got.kind == REVISE and (got.index, got.correction) == (want.index, want.correction)
    return right / len(attempts)


def train_instruct(tok, student):
    """toy:instruct: a copy of the student fine-tuned by INSTRUCT_SFT (its own mix, longer plain chains and InT's
    proposer task, on its own failures too); prints time and proposal accuracy on held-out failed attempts."""
    import copy

    import torch

    recipe = dict(INSTRUCT_SFT)
    torch.manual_seed(recipe["seed"])
    model = copy.deepcopy(student)
    t0 = time.time()
    failures = own_failures(student, tok)
    print(f"[bootstrap] instruct: from the student, {len(failures)} of its own failed attempts in the proposer "
          f"task; plain chains of {recipe['tiers']} steps", flush=True)
    phases = sft(model, tok, **recipe, failures=failures)
    print(f"[bootstrap] instruct: trained in {time.time() - t0:.1f}s; (updates, loss) per phase {phases}", flush=True)
    acc = proposal_accuracy(model, tok, held_out_failures(model, tok))
    print(f"[bootstrap] instruct: proposal accuracy {acc:.3f} (greedy 'REVISE k' and the right line k, "
          f"held-out failed attempts)", flush=True)
    return model


def reward_pair(rng: random.Random, tiers) -> tuple[str, str, str]:
    """One (prompt, response, the reference solution) example for toy:reward: a right solution or a failed attempt."""
    ex = toy.make_example(toy.random_problem(rng, rng.choice(tiers), "train"))
    text = ex.solution if rng.random() < 0.5 else "\n".join(failed_attempt(rng, ex))
    return ex.prompt, text, ex.solution


def on_solution(text: str, solution: str) -> list[float]:
    """Per character of `text`: 1.0 while text[:i + 1] is a prefix of `solution`, 0.0 from the first one that is not."""
    out, ok = [], True
    for i, c in enumerate(text):
        ok = ok and i < len(solution) and solution[i] == c
        out.append(1.0 if ok else 0.0)
    return out


def reward_batch(rng: random.Random, tok, n: int, tiers):
    """Right-padded ids [n, L], mask [n, L] (real tokens), labels [n, L] (1 on the solution's way, 0 off it) and the
    response tokens [n, L] (the positions that get loss). <eos> after a whole solution is on its way."""
    import torch

    seqs, labels = [], []
    for _ in range(n):
        prompt, text, solution = reward_pair(rng, tiers)
        lab = on_solution(text, solution)
        ids = tok.encode(prompt + text)
        if rng.random() < 0.5:
            ids.append(tok.eos_token_id)
            lab.append(1.0 if text == solution else 0.0)
        seqs.append((ids, len(ids) - len(lab)))
        labels.append(lab)
    L = max(len(x) for x, _ in seqs)
    ids = torch.full((n, L), tok.pad_token_id)
    mask = torch.zeros((n, L), dtype=torch.bool)
    target = torch.zeros((n, L))
    resp = torch.zeros((n, L), dtype=torch.bool)
    for i, ((x, p), lab) in enumerate(zip(seqs, labels)):
        ids[i, : len(x)], mask[i, : len(x)] = torch.tensor(x), True
        target[i, p: len(x)], resp[i, p: len(x)] = torch.tensor(lab), True
    return ids, mask, target, resp


def token_scores(model, ids, mask):
    """[n, L] the score head of a sequence-classification model at every position (right padding: causal attention
    never reads a pad before a real token)."""
    return model.score(model.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state).squeeze(-1)


def reward_net(student, seed: int):
    """A Qwen3ForSequenceClassification (one output) with the student's backbone and a fresh `score` head."""
    import copy

    import torch
    from transformers import Qwen3ForSequenceClassification

    cfg = copy.deepcopy(student.config)
    cfg.num_labels = 1
    torch.manual_seed(seed)
    net = Qwen3ForSequenceClassification(cfg)
    net.model.load_state_dict(student.model.state_dict())
    return net


def reward_accuracy(model, tok, n: int = 512, seed: int = 9) -> float:
    """The share of held-out examples (right solutions and failed attempts of eval-split chains) whose last-token
    score has the sign of the verifier's verdict (score > 0 exactly for reward 1)."""
    import torch

    from components.tasks.verifiers import toy_verifier

    rng, right = random.Random(seed), 0
    for _ in range(n):
        ex = toy.make_example(toy.random_problem(rng, rng.choice(REWARD_SFT["tiers"]), "eval"))
        text = ex.solution if rng.random() < 0.5 else "\n".join(failed_attempt(rng, ex))
        ids = torch.tensor([tok.encode(ex.prompt + text)])
        with torch.no_grad():
            score = float(token_scores(model, ids, torch.ones_like(ids, dtype=torch.bool))[0, -1])
        right += (score > 0) == (toy_verifier(text, ex).reward >= 1.0)
    return right / n


def train_reward(tok, student):
    """toy:reward: a Qwen3ForSequenceClassification (one output) from the student's backbone and a fresh head, trained
    by REWARD_SFT (binary cross-entropy of every response token's score against whether the response is still on its
    solution's way); prints its time and held-out sign accuracy at the last token."""
    import torch
    import torch.nn.functional as F

    recipe = REWARD_SFT
    model = reward_net(student, recipe["seed"])
    model.config.pad_token_id = tok.pad_token_id
    rng = random.Random(recipe["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], betas=(0.9, 0.99), weight_decay=0.01)
    model.train()
    t0, ema = time.time(), None
    for step in range(recipe["updates"]):
        scale = min(1.0, (step + 1) / recipe["warmup"]) * (1.0 - 0.9 * step / recipe["updates"])
        for g in opt.param_groups:
            g["lr"] = recipe["lr"] * scale
        ids, mask, target, resp = reward_batch(rng, tok, recipe["batch"], recipe["tiers"])
        score = token_scores(model, ids, mask)  # [n, L]
        loss = F.binary_cross_entropy_with_logits(score[resp], target[resp])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if (step + 1) % 50 == 0:
            print(f"  reward step {step + 1:5d}  loss {ema:.4f}  {time.time() - t0:6.1f}s", flush=True)
    model.eval()
    acc = reward_accuracy(model, tok)
    print(f"[bootstrap] reward: trained in {time.time() - t0:.1f}s; held-out sign accuracy {acc:.3f} at the last "
          "token (right solutions and failed attempts, tiers 1-8)", flush=True)
    return model


# ------------------------------------------------------------------------------------------ toy:tools


def sample(model, tok, prompts: list[str], max_new_tokens: int, temperature: float = 1.0, batch: int = 128) -> list[str]:
    """Sampled completions of `prompts` (temperature, no top-k / top-p), special tokens removed; greedy at 0."""
    import torch

    tok.padding_side = "left"
    out = []
    for i in range(0, len(prompts), batch):
        enc = tok(prompts[i : i + batch], return_tensors="pt", padding=True)  # [B, L]
        kw = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else \
            {"do_sample": False}
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id, **kw)  # [B, L + new]
        out += tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def own_attempts(model, tok, tiers, n: int, seed: int) -> dict:
    """{problem: a sampled attempt (temperature 1)} of `model` at `n` train-split chains of each of `tiers` steps."""
    import torch

    torch.manual_seed(seed)
    out = {}
    for tier in tiers:
        exs = toy.make_examples(tier, n, seed, "train")
        texts = sample(model, tok, [e.prompt for e in exs], toy.max_new_tokens_for(tier))
        out.update({e.problem: t.strip() for e, t in zip(exs, texts)})
    return out


def tools_example(rng: random.Random, recipe: dict, own: dict, kind: str) -> list[tuple[str, bool]]:
    """One toy:tools demonstration of `kind` (a key of recipe['batches']) as [(text, trained)]: the prompt (never
    trained), then the response's pieces. `call`: the tools prompt, then the policy's call (its first token, the
    decision to call, trained with the probability that makes a call `recipe['call']` of the decisions), the
    environment's answer (never trained) and the policy's '#N'; `tools` / `plain`: the tools / plain prompt, then the
    student's answer (the reference solution, or on a long chain its own attempt from `own`); `formats`: a
    privileged-context format of MIX, as the student learned it. An eos (trained) follows the last piece."""
    if kind == "formats":
        fmt = pick_format(rng, {k: v / sum(MIX.values()) for k, v in MIX.items()})
        prompt, target = mix_pair(rng, fmt, recipe["solved_tiers"], recipe["tiers"])
        return [(prompt, False), (target, True)]
    b = recipe["batches"]  # P(decision trained) q: q b_call / (q b_call + b_tools) = call
    q = min(1.0, recipe["call"] * b["tools"] / ((1 - recipe["call"]) * b["call"]))
    decide = kind == "call" and rng.random() < q
    long_tiers = [t for t in recipe["tiers"] if t not in recipe["solved_tiers"]]
    if kind == "call" and not decide and rng.random() < recipe["call_long"]:
        tier = rng.choice(long_tiers)  # copying a long chain into the call is what takes learning
    else:
        tier = rng.choice(recipe["tiers"])
    problems = [p for p in own if len(p) == 2 * tier + 1]
    if tier in recipe["solved_tiers"] or not problems:
        problem = toy.random_problem(rng, tier, "train")
        answer = toy.make_example(problem).solution
    else:  # a long chain: the student's own attempt
        problem = rng.choice(problems)
        answer = own[problem]
    if kind == "plain":
        return [(toy.TEMPLATES["prompt"].format(problem=problem), False), (answer, True)]
    prompt = toy.TEMPLATES["tools"].format(problem=problem)
    if kind == "tools":
        return [(prompt, False), (answer, True)]
    (_, call), (_, env), (_, last) = toy.tool_demonstration(problem)
    return [(prompt, False), (call[0], decide), (call[1:], True), (env, False), (last, True)]


def segment_tensors(examples: list[list[tuple[str, bool]]], tok):
    """Right-padded input_ids / labels [B, L] of [(text, trained)] pieces (an eos after the last, trained): labels
    are the ids of trained pieces and -100 elsewhere (prompt, environment text, padding)."""
    import torch

    seqs, labels = [], []
    for pieces in examples:
        ids, lab = [], []
        for text, trained in pieces:
            x = tok.encode(text)
            ids += x
            lab += x if trained else [-100] * len(x)
        ids.append(tok.eos_token_id)
        lab.append(tok.eos_token_id)
        seqs.append(ids)
        labels.append(lab)
    L = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), L), tok.pad_token_id)  # [B, L]
    lab = torch.full((len(seqs), L), -100)  # [B, L]
    for i, (x, y) in enumerate(zip(seqs, labels)):
        ids[i, : len(x)], lab[i, : len(y)] = torch.tensor(x), torch.tensor(y)
    return ids, lab


def train_tools(tok, student, recipe: dict | None = None):
    """toy:tools: a copy of the student fine-tuned by TOOLS_SFT (AdamW, the learning rate decaying linearly to 10% over
    the second half); prints its time and tool_report."""
    import copy

    import torch
    import torch.nn.functional as F

    recipe = {**TOOLS_SFT, **(recipe or {})}
    t0, c0 = time.time(), time.process_time()
    long_tiers = [t for t in recipe["tiers"] if t not in recipe["solved_tiers"]]
    own = own_attempts(student, tok, long_tiers, recipe["own_per_tier"], recipe["seed"])
    print(f"[bootstrap] tools: from the student, {len(own)} of its own attempts at chains of {long_tiers} steps "
          f"({time.time() - t0:.1f}s)", flush=True)
    torch.manual_seed(recipe["seed"])
    rng = random.Random(recipe["seed"])
    model = copy.deepcopy(student)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], betas=(0.9, 0.99), weight_decay=0.1)
    model.train()
    n, ema = recipe["updates"], None
    for step in range(n):
        scale = min(1.0, (step + 1) / recipe["warmup"])
        if step >= n // 2:
            scale = 1.0 - 0.9 * (step - n // 2) / max(1, n - n // 2)
        for g in opt.param_groups:
            g["lr"] = recipe["lr"] * scale
        kind = pick_format(rng, recipe["batches"])
        ids, lab = segment_tensors([tools_example(rng, recipe, own, kind) for _ in range(recipe["batch"])], tok)  # [B, L]
        logits = model(input_ids=ids).logits  # [B, L, V]; right padding needs no mask under causal attention
        # summed over tokens, over a fixed count (not the batch's): a trained token weighs the same in a batch of long
        # call demonstrations as in one of short solutions, so the decisions' shares are the recipe's
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), lab[:, 1:].reshape(-1), ignore_index=-100,
                               reduction="sum") / (recipe["batch"] * TOKENS_PER_EXAMPLE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if (step + 1) % 100 == 0:
            print(f"  tools step {step + 1:5d}  loss {ema:.4f}  {time.time() - t0:6.1f}s", flush=True)
    model.eval()
    print(f"[bootstrap] tools: trained in {time.time() - t0:.1f}s, {time.process_time() - c0:.1f}s of CPU ({n} updates, "
          f"loss {ema:.4f})", flush=True)
    return model


def tool_episodes(model, tok, examples, temperature: float = 1.0, calculator=None) -> list[dict]:
    """Episodes of the tool task on `examples` (prompts in the tools format), run the way a tool environment runs
    them: the policy writes until its eos, or a turn that closes a tool call (cut after </tool_call>); a call is
    answered with `calculator(expression)` (default toy.calculate; an unreadable call or a failing expression gets
    'error'), the answer appended as the environment's text, and the policy writes once more. Per example:
    {text (the whole response), called, correct_call (a calculator call whose expression evaluates to the answer),
    reward (the toy verifier's)}."""
    from components.tasks.verifiers import toy_verifier

    calculator = calculator or toy.calculate
    cap = toy.max_new_tokens_for(max(e.tier for e in examples), "tools")
    first = sample(model, tok, [e.prompt for e in examples], cap, temperature)
    out, again = [], []
    for i, (ex, text) in enumerate(zip(examples, first)):
        end = text.find(toy.TOOL_CALL_CLOSE)
        ep = {"text": text, "called": end >= 0, "correct_call": False}
        if end >= 0:
            text = text[: end + len(toy.TOOL_CALL_CLOSE)]
            call = toy.parse_tool_call(text)
            try:
                result = calculator(call[1]["expression"]) if call and call[0] == toy.TOOL else "error"
            except (ValueError, KeyError, TypeError):
                result = "error"
            ep["correct_call"] = result == ex.answer
            ep["text"] = text + toy.tool_response_text(result)
            again.append(i)
        out.append(ep)
    if again:
        rest = sample(model, tok, [examples[i].prompt + out[i]["text"] for i in again], 8, temperature)
        for i, text in zip(again, rest):
            out[i]["text"] += text
    for ep, ex in zip(out, examples):
        ep["reward"] = toy_verifier(ep["text"], ex).reward
    return out


def tool_report(model, tok, tiers=(6, 7, 8), n: int = 64, samples: int = 4, seed: int = 0, calculator=None) -> dict:
    """toy:tools's numbers on `n` eval chains per tier: greedy pass@1 without tools (plain prompt; tools prompt, a call
    then unanswered), and over `samples` sampled episodes (temperature 1) per chain: the share that call the tool,
    that call it correctly, pass@1 of those that call it correctly, of those that do not call, and of all."""
    import torch

    from components.tasks.verifiers import toy_verifier

    exs = [e for t in tiers for e in toy.make_examples(t, n, seed, "eval", "tools")]
    plain = [toy.make_example(e.problem) for e in exs]
    report = {}
    for name, batch in (("greedy_plain", plain), ("greedy_tools_prompt", exs)):
        texts = generate_greedy(model, tok, [e.prompt for e in batch], toy.max_new_tokens_for(max(tiers), "tools"))
        report[name] = sum(toy_verifier(t, e).reward for t, e in zip(texts, batch)) / len(batch)
    torch.manual_seed(seed)
    eps = tool_episodes(model, tok, [e for e in exs for _ in range(samples)], 1.0, calculator)
    called = [e for e in eps if e["called"]]
    right = [e for e in eps if e["correct_call"]]
    silent = [e for e in eps if not e["called"]]
    mean = lambda xs: sum(e["reward"] for e in xs) / len(xs) if xs else float("nan")  # noqa: E731
    report.update(episodes=len(eps), tool_call_rate=len(called) / len(eps), correct_call_rate=len(right) / len(eps),
                  pass_correct_call=mean(right), pass_no_call=mean(silent), pass_sampled=mean(eps))
    return report


def ensure_checkpoints(cache_dir: str | None = None, instruct: bool = False, reward: bool = False,
                       tools: bool = False) -> dict:
    """Directories {tokenizer, student, teacher, instruct, reward, tools}, bootstrapped on first call (a few minutes on
    2 cores). toy:instruct, InT's base, is built from the student only when asked for (`instruct`, as resolving
    `toy:instruct` does), in about 8 more minutes; toy:reward (PPO-RM's reward model) likewise (`reward`), in about
    a minute; toy:tools (the tool task's base) likewise (`tools`): runs that never name them never wait for them,
    and the default cache key does not change.

    Idempotent; concurrent callers wait on a file lock and reuse the result.
    """
    folder = cache_folder(cache_dir)
    paths = {k: os.path.join(folder, k) for k in ("tokenizer", "student", "teacher")}
    paths["instruct"] = os.path.join(folder, INSTRUCT_DIR)
    paths["reward"] = os.path.join(folder, REWARD_DIR)
    paths["tools"] = os.path.join(folder, TOOLS_DIR)
    asked = {"instruct": instruct, "reward": reward, "tools": tools}
    need = [p for k, p in paths.items() if asked.get(k, True)]
    if all(os.path.isdir(p) for p in need):
        return paths
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if all(os.path.isdir(p) for p in need):
            return paths
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        threads = torch.get_num_threads()
        torch.set_num_threads(int(os.environ.get("COMPOSER_THREADS") or 2))  # 1 on a busy machine: no thread contention
        t_start = time.time()
        if not os.path.isdir(paths["tokenizer"]):
            tmp = f"{paths['tokenizer']}.tmp-{os.getpid()}"
            build_char_tokenizer(tmp)
            os.rename(tmp, paths["tokenizer"])
        tok = AutoTokenizer.from_pretrained(paths["tokenizer"])
        models = {}
        if not os.path.isdir(paths["student"]):
            models["student"] = train_model("student", tok)
            _save(models["student"], tok, paths["student"])
        if not os.path.isdir(paths["teacher"]):
            student = models.get("student") or AutoModelForCausalLM.from_pretrained(paths["student"])
            models["teacher"] = train_model("teacher", tok, init=student)
            _save(models["teacher"], tok, paths["teacher"])
        if instruct and not os.path.isdir(paths["instruct"]):  # added later (issue 41): a cache gains it when asked
            student = models.get("student") or AutoModelForCausalLM.from_pretrained(paths["student"])
            t0 = time.time()
            models["instruct"] = train_instruct(tok, student)
            _save(models["instruct"], tok, paths["instruct"])
            print(f"[bootstrap] instruct: built in {time.time() - t0:.1f}s", flush=True)
        if reward and not os.path.isdir(paths["reward"]):  # added later (issue 46): a cache gains it when asked
            student = models.get("student") or AutoModelForCausalLM.from_pretrained(paths["student"])
            t0 = time.time()
            _save(train_reward(tok, student), tok, paths["reward"])
            print(f"[bootstrap] reward: built in {time.time() - t0:.1f}s", flush=True)
        if tools and not os.path.isdir(paths["tools"]):  # added later (issue 55): a cache gains it when asked
            student = models.get("student") or AutoModelForCausalLM.from_pretrained(paths["student"])
            t0 = time.time()
            _save(train_tools(tok, student), tok, paths["tools"])
            print(f"[bootstrap] tools: built in {time.time() - t0:.1f}s", flush=True)
        print(f"[bootstrap] total {time.time() - t_start:.1f}s", flush=True)
        if models:  # the language models this call trained
            print("greedy pass@1 (64 eval problems per tier):", flush=True)
            print(pass_table(models, tok), flush=True)
            print("with the reference solution in the prompt (template 'reference'):", flush=True)
            print(pass_table(models, tok, template="reference"), flush=True)
        torch.set_num_threads(threads)
    return paths


# --------------------------------------------------------------------------------- smoke tests


def tiny_random_checkpoint(out_dir: str, layers: int = 2, hidden: int = 64) -> str:
    """An untrained tiny Qwen3 with the char tokenizer, saved to `out_dir` (for smoke tests)."""
    tok = char_tokenizer()
    model = qwen3(len(tok), layers=layers, hidden=hidden, heads=2, kv_heads=1, intermediate=2 * hidden, tok=tok)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def other_vocab_checkpoint(out_dir: str) -> str:
    """A tiny random checkpoint whose tokenizer has a different vocabulary (tokenizer-mismatch tests)."""
    tok = other_vocab_tokenizer()
    model = qwen3(len(tok), layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, tok=tok)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def tools_report_main() -> None:
    """`python -m components.tasks.bootstrap --tools-report`: builds toy:tools when missing, then prints tool_report
    (greedy pass@1 without tools, the tool-call rate of sampled episodes and their pass@1) on chains of 6-8 steps."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    paths = ensure_checkpoints(tools=True)
    torch.set_num_threads(int(os.environ.get("COMPOSER_THREADS") or 2))
    model, tok = AutoModelForCausalLM.from_pretrained(paths["tools"]), AutoTokenizer.from_pretrained(paths["tools"])
    t0 = time.time()
    report = tool_report(model, tok)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in report.items()}, indent=1))
    print(f"[bootstrap] tools: report in {time.time() - t0:.1f}s (64 eval chains per tier of 6, 7, 8 steps; 4 sampled "
          "episodes each at temperature 1, the calculator toy.calculate)", flush=True)


if __name__ == "__main__":
    import sys

    if "--tools-report" in sys.argv[1:]:
        tools_report_main()
    else:
        print(ensure_checkpoints())
