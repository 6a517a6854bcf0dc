"""Episodes: rollouts that alternate policy turns and environment turns (`rollout.environment`, issue 55).

The program of one episode (composer/protocol.py), run by the Lightning driver in lockstep with the step's other
rows and by OpenRLHF's agent one row at a time:

    trace = prompt
    opening = env.reset(example)                      (environment tokens, when not empty)
    repeat up to max_turns:
        the policy writes a turn: up to its end of turn, a stop string of the environment (`</tool_call>`: the
            turn is cut right after the token that completes it; what the sampler wrote after is dropped, as a stop
            string in vLLM drops it), or the end of its budget (rollout.max_new_tokens over the whole episode)
        answer, reward, done = env.step(the turn's text)
        the answer is appended as `environment` tokens: plain prompts get `env.render_plain(answer)`; chat prompts
            the chat template's rendering of a message of role `env.role` after the policy's turn (the template's
            end of turn, the message, the next generation prompt)
        stop when done, when the answer is empty (the policy answered without a call), when the answer would pass
            max_env_tokens, or after the last turn (a call in it is never executed)

The environment is pure text (composer/contract.py `Environment`); nothing here imports torch. What the episode did
is in `trace.notes["env"]` (turns, environment tokens, why it ended, the environment's facts such as tool calls and
tool errors, the per-turn rewards); `facts` averages them over a batch for the step's metrics (env/*).

The verifier of an episode reads its final answer: the response's text after the last environment turn that the
policy answered (`answer_span`), which is the whole response when no environment token is in it.
"""

from __future__ import annotations

from composer.protocol import Sample, Trace

PROBE = "Zq7EnvironmentProbe"  # an assistant message's text, found again in the rendered conversation


def episode_row(ctx, example, env):
    """The program of one episode of `example` with the environment part `env` (an active Environment)."""
    trace = Trace(ctx.prompt_ids(example))
    session = env.session()
    notes = {"turns": 0, "env_tokens": 0, "env_turns": 0, "ended": "turns", "rewards": [], "cut": False}
    policy_left, env_left = ctx.max_new_tokens, env.max_env_tokens
    opening = session.reset(example) or ""
    if opening:
        ids = ctx.encode(opening)
        if len(ids) > env_left:
            notes["ended"] = "env_budget"
            trace.notes["env"] = {**notes, **env.facts(session)}
            return trace
        trace.add(ids, "environment")
        env_left -= len(ids)
        notes["env_tokens"] += len(ids)
    stops = env.stop_strings()
    for turn in range(env.max_turns):
        if policy_left <= 0:
            notes["ended"] = "budget"
            break
        [gen] = yield Sample(trace.tokens, policy_left, stop=tuple(stops))
        tokens, lps, hit = cut_at_stop(ctx.decode, gen.tokens, gen.logprobs, stops)
        trace.add(tokens, "policy", lps)
        policy_left -= len(tokens)
        notes["turns"] += 1
        if not hit and not gen.finished:  # cut by the budget in the middle of a turn
            notes["ended"], notes["cut"] = "budget", True
            break
        if turn == env.max_turns - 1:  # the last turn: never answered (a call in it is not executed)
            notes["ended"] = "turns" if hit else "answered"
            break
        answer, reward, done = session.step(ctx.decode(tokens))
        if reward is not None:
            notes["rewards"].append(float(reward))
        if not answer:  # nothing to say: the policy answered without a call (or the environment ended it silently)
            notes["ended"] = "answered" if not hit else "environment"
            break
        ids = answer_ids(ctx, env, answer)
        if len(ids) > env_left:
            notes["ended"] = "env_budget"
            break
        trace.add(ids, "environment")
        env_left -= len(ids)
        notes["env_tokens"] += len(ids)
        notes["env_turns"] += 1
        if done:
            notes["ended"] = "environment"
            break
    trace.notes["env"] = {**notes, **env.facts(session)}
    return trace


def cut_mid_turn(notes) -> bool | None:
    """Whether an episode's policy was cut by its budget in the middle of a turn: DAPO's overlong case, what the
    `truncated` flag and `rollout.filter.truncated` mean for an episode (one the environment ended, or whose last
    call the turn limit left unanswered, ends on no stop token and is not cut). None for a row that is no episode:
    its response is cut when it does not end in a stop token."""
    env = notes.get("env") if isinstance(notes, dict) else None
    return bool(env.get("cut")) if isinstance(env, dict) else None


def cut_at_stop(decode, tokens: list[int], logprobs, stops) -> tuple[list[int], list | None, bool]:
    """(the turn's tokens up to and including the token that completes the first stop string, their log-probs,
    whether a stop string ended it). The sampler's log-probs of the kept tokens are unchanged: a stop string only
    drops what follows it."""
    if not stops or not any(s in decode(list(tokens)) for s in stops):
        return list(tokens), logprobs, False
    lo, hi = 1, len(tokens)  # the shortest prefix whose text holds a stop string (holding one only grows with k)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(list(tokens[:mid])) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return list(tokens[:lo]), None if logprobs is None else list(logprobs[:lo]), True


def chat_mode(ctx) -> bool:
    """Prompts are rendered with the policy's chat template."""
    return ctx.prompt_format().mode == "chat"


def answer_ids(ctx, env, answer: str) -> list[int]:
    """The environment tokens of `answer`: plain prompts `env.render_plain(answer)`; chat prompts the template's
    rendering of a message of role `env.role` after an assistant turn (see `chat_suffix`)."""
    if chat_mode(ctx):
        fmt = ctx.prompt_format()
        return ctx.encode(chat_suffix(ctx.tokenizer, env.role, answer, fmt.kwargs))
    return ctx.encode(env.render_plain(answer))


def chat_suffix(tokenizer, role: str, content: str, kwargs: dict | None = None) -> str:
    """What the chat template writes between the end of an assistant's text and the next assistant turn's first
    token when a message (`role`, `content`) follows it: the assistant's end of turn, the message, the generation
    prompt. Found by rendering a conversation with a probe as the assistant's text, with and without the message."""
    from composer.template_limits import render

    base = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": PROBE}]
    before = render(tokenizer, base, dict(kwargs or {}), add_generation_prompt=False)
    after = render(tokenizer, base + [{"role": role, "content": content}], dict(kwargs or {}),
                   add_generation_prompt=True)
    if PROBE not in before or PROBE not in after:
        raise ValueError("the chat template drops the assistant's text: the environment's message cannot be placed "
                         "after it")
    cut = after.index(PROBE) + len(PROBE)
    if after[:cut] != before[: before.index(PROBE) + len(PROBE)]:
        raise ValueError(f"the chat template renders the conversation before a {role} message differently: the "
                         "environment's message cannot be appended to the policy's turn")
    return after[cut:]


# ------------------------------------------------------------------------------------------ reading episodes


def answer_span(origins: list[str]) -> tuple[int, int]:
    """[start, end) of a response's final answer among its tokens' origins: the tokens after the last environment
    turn that the policy answered (the last run of non-environment tokens holding a policy token); the whole response
    when it holds no environment token (or no such run)."""
    if "environment" not in origins:
        return 0, len(origins)
    runs, start = [], None
    for i, o in enumerate(origins + ["environment"]):
        if o != "environment" and start is None:
            start = i
        elif o == "environment" and start is not None:
            runs.append((start, i))
            start = None
    for s, e in reversed(runs):
        if any(o == "policy" for o in origins[s:e]):
            return s, e
    return 0, len(origins)


def turns_of(tokens: list[int], origins: list[str]) -> list[tuple[str, list[int]]]:
    """A response as its turns: [(origin group, tokens)], 'environment' runs and the runs between them ('policy')."""
    out: list[tuple[str, list[int]]] = []
    for t, o in zip(tokens, origins):
        who = "environment" if o == "environment" else "policy"
        if out and out[-1][0] == who:
            out[-1][1].append(t)
        else:
            out.append((who, [t]))
    return out


def facts(notes: list) -> dict[str, float]:
    """Per-row means over a batch's episodes (rows whose notes hold `env`): env/turns (policy turns), env/env_turns
    (environment answers), env/env_tokens, every count the environment reports (env/tool_calls, env/tool_errors),
    env/turn_reward (the sum of per-turn rewards), and the fraction of episodes ended by each cause
    (env/ended_<why>: answered, environment, turns, budget, env_budget). {} when no row is an episode."""
    eps = [n["env"] for n in notes if isinstance(n, dict) and isinstance(n.get("env"), dict)]
    if not eps:
        return {}
    out: dict[str, float] = {}
    keys = sorted({k for e in eps for k, v in e.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    for k in keys:
        out[f"env/{k}"] = sum(float(e.get(k, 0)) for e in eps) / len(eps)
    out["env/turn_reward"] = sum(sum(e.get("rewards", [])) for e in eps) / len(eps)
    for why in ("answered", "environment", "turns", "budget", "env_budget"):
        out[f"env/ended_{why}"] = sum(e.get("ended") == why for e in eps) / len(eps)
    return out


def episode_generations(ctx, env, examples: list, n: int, generate) -> list:
    """Evaluation under an environment: n episodes per example (in order), each policy turn written by
    `generate(prompts, max_new_tokens) -> [Generation]` (the evaluated weights, greedy or sampled), each returned as a
    Generation of its final answer's tokens (`answer_span`: what the verifier reads), finished when its last policy
    turn ended at a stop token. One `generate` call per round of turns, at the round's largest budget, each row cut to
    its own (a sample cut at a budget is a sample under that budget)."""
    from composer.protocol import Generation, drive

    def serve(key, requests):
        cap = max(r.max_tokens for r in requests)
        gens = generate([r.tokens for r in requests], cap)
        out = []
        for r, g in zip(requests, gens):
            cut = len(g.tokens) > r.max_tokens
            toks = list(g.tokens[: r.max_tokens])
            out.append([Generation(toks, g.finished and not cut, None if g.logprobs is None else g.logprobs[: len(toks)])])
        return out

    traces = drive([episode_row(ctx, ex, env) for ex in examples for _ in range(n)], serve)
    stops = set(ctx.stop_ids)
    out = []
    for t in traces:
        origins = [p.origin for p in t.pieces for _ in p.tokens]
        s, e = answer_span(origins)
        toks = t.response[s:e]
        out.append(Generation(toks, bool(toks) and toks[-1] in stops))
    return out
