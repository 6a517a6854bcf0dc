"""Rollout samples a run keeps: `samples.jsonl` in the run folder, one JSON object per rollout.

Each object: step, segment, term, row, prompt, response, the response as `spans` [{origin, text, tokens}]
(policy / guide_prefix / guide_intervention / demonstration / environment), reward, the verifier's verdict (parsed,
detail) when it gave one, `truncated` for the rows the policy sampled (cut at max_new_tokens), and for
guided rollouts what the guide did (the judge's verdicts and corrections, reviews). Written at every
`train.samples_every`-th step, at evaluation steps and at the last step; `composer samples RUN` prints them.

The file only ever grows by whole lines: a step's rows go in one append, and a failed append is cut back
to the last whole line. A resumed run drops the rows of the steps it trains again (step >= the
checkpoint's step), so no step appears twice. Writing samples never stops a run: a failure is a warning.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import stat
from pathlib import Path

from composer import files

SAMPLES = "samples.jsonl"
GUIDE_ORIGINS = ("guide_prefix", "guide_intervention", "demonstration")
GUIDE_NOTES = ("verdicts", "corrections", "reviews", "malformed", "dropped_tokens")
TEXT_ROWS = 4  # rows of a step shown as TensorBoard / W&B / MLflow text

log = logging.getLogger("composer")


# ------------------------------------------------------------------------------------------ rows


def _num(value):
    """A JSON-safe number: NaN and inf become None."""
    value = float(value)
    return value if math.isfinite(value) else None


def _plain(value):
    if isinstance(value, float):
        return _num(value)
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
        return _plain(value.item())
    return str(value)


def row_advantages(batch) -> list | None:
    """Each row's advantage: the objective's per-row advantage, or the mean of its per-token advantages (a critic's
    GAE, ppo) over the row's response tokens."""
    adv = batch.advantages
    if adv is None:
        return None
    adv = adv.detach().float().cpu()
    if adv.dim() == 2:
        m = batch.response_mask.cpu().float()
        adv = (adv * m).sum(1) / m.sum(1).clamp(min=1)
    return adv.tolist()


def rows_of(batch, tokenizer, step: int, segment: str = "", term: str = "") -> list[dict]:
    """One JSON-ready dict per row of a TrajectoryBatch (after its signal: rewards and verdicts filled)."""
    from composer.origins import CODE, ORIGINS

    tokens = batch.tokens.detach().cpu().tolist()
    origin = batch.origin.detach().cpu().tolist()
    rewards = batch.rewards.detach().float().cpu().tolist() if batch.rewards is not None else None
    advantages = row_advantages(batch)
    verdicts = batch.info.get("verdicts") if isinstance(batch.info, dict) else None
    if not isinstance(verdicts, list) or len(verdicts) != batch.size:
        verdicts = None
    truncated = batch.info.get("truncated") if isinstance(batch.info, dict) else None  # the step marks rollouts
    if not isinstance(truncated, list) or len(truncated) != batch.size:
        truncated = None
    flags = {k: getattr(batch, k).detach().cpu().tolist() if getattr(batch, k, None) is not None else None
             for k in ("guided", "control", "prompt_index", "group")}

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    out = []
    for i in range(batch.size):
        prompt_ids, spans = [], []
        for tok, code in zip(tokens[i], origin[i]):
            if code == CODE["pad"]:
                continue
            if code == CODE["prompt"] and not spans:  # a conversation's later turns are prompt spans between answers
                prompt_ids.append(tok)
            elif spans and spans[-1][0] == code:
                spans[-1][1].append(tok)
            else:
                spans.append((code, [tok]))
        ex = batch.examples[i] if i < len(batch.examples or []) else None
        conv = ex is not None and getattr(ex, "conversation", None) is not None  # a messages row: up to its 1st answer
        row = {
            "step": int(step), "segment": segment, "term": term, "row": i,
            "prompt": (tokenizer.decode(prompt_ids) if conv else ex.prompt) if ex is not None else decode(prompt_ids),
            "response": decode([t for c, ids in spans if c != CODE["prompt"] for t in ids]),
            "spans": [{"origin": ORIGINS[c], "text": decode(ids), "tokens": len(ids)} for c, ids in spans],
            "reward": _num(rewards[i]) if rewards is not None else None,
        }
        if ex is not None:
            row["answer"] = ex.answer
            if ex.tier is not None:
                row["tier"] = ex.tier
        if advantages is not None:
            row["advantage"] = _num(advantages[i])
        if truncated is not None:  # cut at max_new_tokens (no stop token at its end)
            row["truncated"] = bool(truncated[i])
        for k, v in flags.items():
            if v is not None:
                row[k] = v[i]
        if verdicts is not None:
            v = verdicts[i]
            row["verifier"] = {"parsed": bool(getattr(v, "parsed", True)), "detail": str(getattr(v, "detail", ""))}
            if getattr(v, "answer", None) is not None:  # what the verifier read as the final answer
                row["verifier"]["answer"] = str(v.answer)
        notes = batch.notes[i] if i < len(batch.notes or []) and isinstance(batch.notes[i], dict) else {}
        guide = {k: _plain(notes[k]) for k in GUIDE_NOTES if k in notes}
        if guide:
            row["guide"] = guide
        if isinstance(notes.get("env"), dict):  # an episode (rollout.environment): its turns, calls, why it ended
            row["environment"] = _plain(notes["env"])
        out.append(row)
    return out


def step_batches(events: list[tuple]) -> list[tuple]:
    """(term, batch) per distinct rollout of a step's `term_loss` events: terms that share a rollout
    (their views share its tokens) give one, the first whose signal set rewards."""
    chosen: dict[int, tuple] = {}
    for term, batch in events:
        key = id(batch.tokens)
        if key not in chosen or (chosen[key][1].rewards is None and batch.rewards is not None):
            chosen[key] = (term, batch)
    return list(chosen.values())


# ------------------------------------------------------------------------------------------ the file


MAX_LINE = 16 << 20  # bytes: a longer line is not one a run wrote (it is skipped, never read whole)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _well_formed(row) -> bool:
    """A row as a run writes it: what `composer samples` prints has the types it prints."""
    if not isinstance(row, dict) or type(row.get("step")) is not int:
        return False
    spans = row.get("spans", [])
    if not isinstance(spans, list) or not all(isinstance(x, dict) and isinstance(x.get("text", ""), str)
                                              and isinstance(x.get("origin", ""), str) for x in spans):
        return False
    reward = row.get("reward")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        return False
    for key in ("guide", "verifier"):
        if row.get(key) is not None and not isinstance(row[key], dict):
            return False
    g = row.get("guide") or {}
    return all(g.get(k) is None or isinstance(g[k], list) for k in ("verdicts", "corrections"))


def read(path: Path | str) -> tuple[list[dict], int]:
    """The rows of a samples.jsonl and how many lines could not be read (a cut-off last line, a row of another
    shape). Only a regular file is read (a FIFO would block, /dev/zero would fill memory); OSError otherwise."""
    rows, bad = [], 0
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file (samples.jsonl is one a run writes)")
    with os.fdopen(fd, "rb") as f:
        while raw := f.readline(MAX_LINE):
            if not raw.endswith(b"\n") and len(raw) >= MAX_LINE:
                bad += 1
                while (rest := f.readline(MAX_LINE)) and not rest.endswith(b"\n"):
                    pass
                continue
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (ValueError, RecursionError):
                bad += 1
                continue
            if _well_formed(row):
                rows.append(row)
            else:
                bad += 1
    return rows, bad


def printable(text) -> str:
    """Text for a terminal: control characters (escape sequences from a prompt or a response) shown as \\x1b."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(text))


def prepare(out: Path, keep_before: int | None) -> None:
    """Before the first step: a fresh run starts without samples; a resumed run keeps the rows of the
    steps before `keep_before` (the checkpoint's step) and drops later ones and any cut-off line.
    A failure is a warning: the run goes on (and appends to what is there)."""
    try:
        _prepare(Path(out) / SAMPLES, keep_before)
    except Exception as e:
        log.warning(f"samples: cannot tidy {Path(out) / SAMPLES} for this run ({type(e).__name__}: {e}); "
                    "the run goes on")


def _prepare(path: Path, keep_before: int | None) -> None:
    if not path.exists():
        return
    if keep_before is None:
        path.unlink()
        return
    kept, bad = [], 0
    with open(path, "rb") as f:
        lines = f.readlines()
    for raw in lines:
        try:
            row = json.loads(raw)
        except ValueError:
            bad += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] < keep_before \
                and raw.endswith(b"\n"):
            kept.append(raw)
        else:
            bad += 1
    if bad:
        with files.atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                f.writelines(kept)
                f.flush()
                os.fsync(f.fileno())


def append(path: Path, rows: list[dict]) -> None:
    """Append rows as whole lines in one write; a failed write (a full disk) is cut back to where it began."""
    if not rows:
        return
    data = "".join(json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n" for r in rows).encode("utf-8")
    with files.open_append(path) as f:  # never through a link
        size = f.tell()
        try:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            f.truncate(size)
            raise


# ------------------------------------------------------------------------------------------ the run's writer


class SampleLog:
    """A run's recorder of samples: it keeps the step's `term_loss` batches and, after the step (the
    SampleWriter callback), writes them when the step is due. `chain` gets every event too."""

    def __init__(self, out: Path, chain=None):
        self.path = Path(out) / SAMPLES
        self.chain = chain
        self.events: list[tuple] = []
        self.step: int | None = None
        self.failed = False

    def __call__(self, kind: str, **data) -> None:
        if self.chain is not None:
            self.chain(kind, **data)
        if kind != "term_loss":
            return
        try:
            if data.get("step") != self.step:
                self.events, self.step = [], data.get("step")
            self.segment = data.get("segment", "")
            self.events.append((data.get("term", ""), data["batch"]))
        except Exception:  # never let samples stop a run
            pass

    @staticmethod
    def due(step: int, train, last_step: int) -> bool:
        every = getattr(train, "samples_every", 0)
        if not every:
            return False
        evals = getattr(train, "eval_every", 0)
        return step % every == 0 or bool(evals and step % evals == 0) or step == last_step

    def write_step(self, train, last_step: int, tokenizer, loggers=()) -> list[dict]:
        """Write the held step's rows when it is due; always forget them. Returns the rows written."""
        events, step, self.events = self.events, self.step, []
        if step is None or not events or not self.due(step, train, last_step):
            return []
        try:
            rows = [r for term, b in step_batches(events)
                    for r in rows_of(b, tokenizer, step, getattr(self, "segment", ""), term)]
            append(self.path, rows)
        except Exception as e:
            self._warn(e)
            return []
        for lg in loggers:
            try:
                log_text(lg, rows[:TEXT_ROWS], step)
            except Exception as e:
                self._warn(e, f"cannot log samples to {type(lg).__name__}")
        return rows

    def _warn(self, e: Exception, what: str = "") -> None:
        if not self.failed:
            log.warning(f"samples: {what or f'cannot write {self.path}'} ({type(e).__name__}: {e}); the run goes on")
        self.failed = True


# ------------------------------------------------------------------------------------------ showing them


ENV_MARKS = ("<<", ">>")  # environment-written spans (a tool's answer) in plain text


def marked(row: dict, open_mark: str = "[[", close_mark: str = "]]") -> str:
    """The response with guide-written spans between markers, and environment-written spans (rollout.environment:
    a tool's answer) between << and >>."""
    def one(s):
        if s.get("origin") in GUIDE_ORIGINS:
            return f"{open_mark}{s.get('text', '')}{close_mark}"
        if s.get("origin") == "environment":
            return f"{ENV_MARKS[0]}{s.get('text', '')}{ENV_MARKS[1]}"
        return s.get("text", "")
    return "".join(one(s) for s in row.get("spans", []))


def row_header(row: dict) -> str:
    parts = [f"step {row.get('step')}", f"row {row.get('row')}"]
    if row.get("segment"):
        parts.append(str(row["segment"]))
    if row.get("term"):
        parts.append(f"term {row['term']}")
    if row.get("reward") is not None:
        parts.append(f"reward {row['reward']:.3f}")
    reviewed = "reviews" in (row.get("guide") or {})
    if row.get("guided"):
        parts.append("guided")
    elif row.get("control") is False:
        parts.append("guide kept it as written")
    elif reviewed:
        parts.append("control")
    if row.get("tier") is not None:
        parts.append(f"tier {row['tier']}")
    return " | ".join(parts)


def guide_lines(row: dict) -> list[str]:
    out = []
    g = row.get("guide") or {}
    if g.get("reviews") is not None:
        out.append(f"reviews: {g['reviews']}")
    if g.get("verdicts"):
        out.append("judge verdicts: " + "; ".join(map(str, g["verdicts"])))
    if g.get("corrections"):
        out.append("judge corrections: " + "; ".join(json.dumps(c, ensure_ascii=False) for c in g["corrections"]))
    e = row.get("environment") or {}
    if e:
        counts = ", ".join(f"{k} {e[k]}" for k in sorted(e) if isinstance(e[k], (int, float)) and k != "rewards")
        out.append(f"environment: {counts}; ended: {e.get('ended', '?')}"
                   + (f"; turn rewards {e['rewards']}" if e.get("rewards") else ""))
    v = row.get("verifier") or {}
    if v.get("answer") is not None:
        out.append(f"verifier read: {v['answer']}")
    if v.get("detail") or v.get("parsed") is False:
        out.append(f"verifier: {'unparsed; ' if v.get('parsed') is False else ''}{v.get('detail', '')}".rstrip("; "))
    return out


def markdown(rows: list[dict]) -> str:
    """A few rows as Markdown (TensorBoard's text tab): fenced, guide-written spans in [[...]]."""
    parts = []
    for r in rows:
        body = f"prompt:\n{r.get('prompt', '')}\n\nresponse:\n{marked(r)}"
        extra = "\n".join(guide_lines(r))
        parts.append(f"**{row_header(r)}**\n\n```\n{body.replace('```', '` ` `')}\n```"
                     + (f"\n\n{extra}" if extra else ""))
    return "\n\n---\n\n".join(parts) + "\n\n(`[[...]]`: tokens the guide wrote; `<<...>>`: tokens the environment wrote)"


def log_text(logger, rows: list[dict], step: int) -> None:
    """Show a few rows in the logger's own text view, where it has one."""
    if not rows:
        return
    name = type(logger).__name__
    if name == "TensorBoardLogger":
        logger.experiment.add_text("samples", markdown(rows), global_step=step)
    elif name == "WandbLogger":
        logger.log_text(key="samples", columns=["step", "row", "reward", "prompt", "response"],
                        data=[[r["step"], r["row"], r.get("reward"), r.get("prompt", ""), marked(r)] for r in rows],
                        step=step)
    elif name == "MLFlowLogger":
        logger.experiment.log_text(logger.run_id, markdown(rows), f"samples/step-{step:08d}.md")
