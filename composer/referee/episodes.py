"""The referee's checks of episodes (rollout.environment, issue 55), from the spec and the recorded rollouts alone:

  never-trained origins    no token of an origin no objective may train (composer/origins.py NEVER_LOSS: the
                           environment's) is in a term's loss origins or received gradient (autograd, not masks), or
                           carries a behaviour log-prob
  environment answers      each environment turn is what the declared environment answers to the policy turn before
                           it: the part's `reference_replies` (the tools environment: its calculator written again)
                           on the policy's turns as the referee decodes them, rendered as the spec's prompts show them
  final-answer verdicts    `final_answer`: the tokens the verifier reads, cut by the referee's own reading of the
                           origins (the response after its last environment turn the policy answered); the check of
                           every verdict (composer/referee/__init__.py `_check_verdicts`: the declared verifier run
                           again) decodes these
It names no kind: an environment declares itself `active`, and its reference is its own.
"""

from __future__ import annotations

from composer.origins import CODE, NEVER_LOSS, ORIGINS


def check_episodes(rep, v, plan, rec, events, term_events) -> None:
    from composer.referee.checks import loss_origins
    from composer.referee.record import row_key, segment_spec

    # ---- no never-trained origin in a term's loss origins or its gradient
    for e in term_events:
        declared = set(loss_origins(plan, e["step"], e["term"])) & set(NEVER_LOSS)
        rep.expect("environment tokens never trained", not declared,
                   f"step {e['step']} {e['term']}: the plan trains {sorted(declared)}")
        got = e.get("grad_origins")
        if got is not None:
            rep.expect("environment tokens never trained", not (got & set(NEVER_LOSS)),
                       f"step {e['step']} {e['term']}: gradient reached {sorted(got & set(NEVER_LOSS))} tokens")
    # ---- tokens no objective may train carry no behaviour log-prob (only what the policy sampled has one)
    for k, e in events:
        if k == "rollout":
            m = e["batch"].mask(tuple(NEVER_LOSS))
            if bool(m.any()):
                rep.expect("environment tokens carry no sampling log-prob", not bool(e["batch"].known_mask[m].any()),
                           f"step {e['step']}: environment tokens hold behaviour log-probs (the policy never sampled them)")
    episodes = [(e, segment_spec(v, e["segment"])) for k, e in events if k == "rollout"]
    episodes = [(e, s) for e, s in episodes if s.rollout.environment.active]
    if not episodes:
        return
    tok = rec.tokenizer
    answered = rows = 0

    for e, spec in episodes:
        b, env = e["batch"], spec.rollout.environment
        chat = _chat(spec, tok)
        for i in range(b.size):
            live = b.attention_mask[i].bool()
            codes = b.origin[i][live].tolist()
            ids = b.tokens[i][live].tolist()
            start = next((k for k, c in enumerate(codes) if c != CODE["prompt"]), len(codes))
            turns = _turns(ids[start:], [ORIGINS[c] for c in codes[start:]])
            rows += 1
            if turns and turns[0][0] == "environment":  # the environment's opening (reset): not a reply
                turns = turns[1:]
            asked = [tok.decode(t, skip_special_tokens=True) for who, t in turns[0::2]]
            shown = [t for who, t in turns[1::2]]
            if not shown:
                continue
            want = env.reference_replies(b.examples[i], asked[: len(shown)])
            for k, (got_ids, (text, _reward, _done)) in enumerate(zip(shown, want)):
                rendered = _render(env, text, tok, spec, chat)
                answered += 1
                rep.expect("environment answers as declared", rendered == got_ids,
                           f"step {e['step']} row {i} turn {k}: the environment's tokens "
                           f"{tok.decode(got_ids)!r}, the declared environment answers {tok.decode(rendered)!r} to "
                           f"{asked[k][-80:]!r}")
    rep.note("environment answers as declared", f"{answered} environment turns replayed over {rows} episodes")


def _turns(ids: list[int], origins: list[str]) -> list[tuple[str, list[int]]]:
    """The response as alternating runs: ('policy', ids) for every run of non-environment tokens, ('environment', ids)."""
    out: list[tuple[str, list[int]]] = []
    for t, o in zip(ids, origins):
        who = "environment" if o == "environment" else "policy"
        if out and out[-1][0] == who:
            out[-1][1].append(t)
        else:
            out.append((who, [t]))
    return out


def final_answer(ids: list[int], codes: list[int]) -> list[int]:
    """The response tokens after the last environment run that a policy token follows; if the response ends in
    environment tokens, the policy run before them; the whole response without environment tokens."""
    resp = [(t, c) for t, c in zip(ids, codes) if c != CODE["prompt"]]
    env = CODE["environment"]
    while resp and resp[-1][1] == env:  # trailing environment text: the answer is the run before it
        resp.pop()
    k = len(resp)
    while k > 0 and resp[k - 1][1] != env:
        k -= 1
    return [t for t, _c in resp[k:]]


def _chat(spec, tok) -> bool:
    d = spec.data
    return d.train is not None and d.prompt_format != "plain" and bool(getattr(tok, "chat_template", None))


def _render(env, text: str, tok, spec, chat: bool) -> list[int]:
    if chat:
        from composer.episodes import chat_suffix

        return tok.encode(chat_suffix(tok, env.role, text, spec.data.chat_template_kwargs), add_special_tokens=False)
    return tok.encode(env.render_plain(text), add_special_tokens=False)



def turn_rewards(env, b, tok) -> list[float]:
    """Each row's sum of the per-turn rewards the environment gives, replayed from the spec: the policy turns the
    episode program hands to the environment (each turn but the max_turns-th that ended at a stop string of the
    environment or at a stop token) answered by `env.reference_replies`; rewards None count 0."""
    from composer.stops import of

    stops, ends = env.stop_strings(), set(of(tok).ids)
    out = []
    for i in range(b.size):
        live = b.attention_mask[i].bool()
        codes, ids = b.origin[i][live].tolist(), b.tokens[i][live].tolist()
        start = next((k for k, c in enumerate(codes) if c != CODE["prompt"]), len(codes))
        turns = [t for who, t in _turns(ids[start:], [ORIGINS[c] for c in codes[start:]]) if who == "policy"]
        stepped = []
        for k, t in enumerate(turns[: max(env.max_turns - 1, 0)]):
            text = tok.decode(t, skip_special_tokens=True)
            if (t and t[-1] in ends) or any(s in text for s in stops):
                stepped.append(text)
        replies = env.reference_replies(b.examples[i], stepped) if stepped else []
        out.append(sum(float(r) for _a, r, _d in replies if r is not None))
    return out
