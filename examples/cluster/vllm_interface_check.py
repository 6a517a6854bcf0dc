#!/usr/bin/env python
"""Checks on a GPU that real vLLM behaves as the real-job tests' replaced engine assumes.

tests/openrlhf_real/hf_vllm.py stands in for vLLM in the CPU tests (tests/test_openrlhf_real.py) and states
its assumptions A1-A5 in its docstring; tests/test_vllm_interface.py pins them for the stand-in. This script
asks real vLLM (the version OpenRLHF 0.11.2 pins) the same questions about the toy student checkpoint and
compares against an fp32 HF forward of the same weights:

  A1  greedy at temperature 0 equals the HF argmax; EOS ends a response with finish_reason "stop" and is in
      token_ids; max_tokens ends one with "length"; min_tokens keeps EOS out
  A2  with logprobs_mode="processed_logprobs" the sampled tokens' log-probs are of the tempered distribution
      (log_softmax(logits / T)); with "raw_logprobs" of the model's own
  A3  prompt_logprobs are the model's own in either mode (never tempered: vLLM 0.32's CPU build, as
      tests/test_vllm_real.py checks); position 0 is None
  A4  load_weights under the HF parameter names changes the next generation as an HF model with those
      weights would (the colocated sync's contract)
  A5  a request with SamplingParams.seed samples the same tokens whatever the engine served before, and in a
      batch beside other requests (the composer seeds every rollout request: exact resume)

    python examples/cluster/vllm_interface_check.py          # prints one line per check, exit 1 on a failure

Needs a CUDA GPU and vLLM (`pip install -e '.[gpu]'`); prepared on a CPU machine, not run there.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
TOL = 2e-2  # vLLM's bf16/fp16 kernels against an fp32 HF forward


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("vllm_interface_check: needs a CUDA GPU (torch.cuda.is_available() is False here)")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from composer.runtime.models import resolve

    path = resolve("toy:student")
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    ids = tok("12+7=", add_special_tokens=True)["input_ids"]
    results = []

    def check(name, ok, detail=""):
        results.append(ok)
        print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)

    def logits(seq):  # [T, V] fp32
        with torch.no_grad():
            return hf(input_ids=torch.tensor([seq]).cuda()).logits[0].float().cpu()

    for mode in ("raw_logprobs", "processed_logprobs"):  # A4 (last) changes the HF weights
        llm = LLM(path, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True, logprobs_mode=mode, seed=0)
        T = 1.7
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=T, max_tokens=8, logprobs=1,
                                                                      prompt_logprobs=1), use_tqdm=False)[0]
        o = out.outputs[0]
        lg = logits(ids + list(o.token_ids))
        scale = T if mode.startswith("processed") else 1.0
        want = [float(torch.log_softmax(lg[len(ids) - 1 + i] / scale, -1)[t]) for i, t in enumerate(o.token_ids)]
        got = [o.logprobs[i][t].logprob for i, t in enumerate(o.token_ids)]
        check(f"A2 {mode}: sampled log-probs of {'tempered' if scale != 1 else 'raw'} distribution",
              max(abs(a - b) for a, b in zip(got, want)) < TOL, f"max diff {max(abs(a - b) for a, b in zip(got, want)):.3g}")
        pl = [float(torch.log_softmax(lg[i], -1)[ids[i + 1]]) for i in range(len(ids) - 1)]
        gp = [out.prompt_logprobs[i + 1][ids[i + 1]].logprob for i in range(len(ids) - 1)]
        check(f"A3 {mode}: prompt log-probs are the model's own (not tempered), position 0 None",
              out.prompt_logprobs[0] is None and max(abs(a - b) for a, b in zip(gp, pl)) < TOL)
        if mode == "processed_logprobs":
            g = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=12),
                             use_tqdm=False)[0].outputs[0]
            lg = logits(ids + list(g.token_ids))
            greedy = [int(torch.argmax(lg[len(ids) - 1 + i])) for i in range(len(g.token_ids))]
            check("A1 greedy at temperature 0 = HF argmax", list(g.token_ids) == greedy)
            eos = tok.eos_token_id
            check("A1 finish_reason: stop with EOS in token_ids, else length",
                  (g.finish_reason == "stop") == (g.token_ids[-1] == eos)
                  and (g.finish_reason == "stop" or len(g.token_ids) == 12), g.finish_reason)
            # A5: a seeded request samples the same tokens after other requests and inside a batch
            sp = SamplingParams(temperature=1.5, max_tokens=12, seed=1234)
            first = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0].token_ids
            llm.generate([{"prompt_token_ids": ids}] * 3, SamplingParams(temperature=1.5, max_tokens=12), use_tqdm=False)
            again = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": ids[:-1]}], [sp, SamplingParams(
                temperature=1.5, max_tokens=12)], use_tqdm=False)[0].outputs[0].token_ids
            check("A5 a seeded request samples the same tokens after other requests, in a batch",
                  list(first) == list(again), f"{list(first)} vs {list(again)}")
            m = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12),
                             use_tqdm=False)[0].outputs[0]
            check("A1 min_tokens keeps EOS out", eos not in m.token_ids[:12])
            # A4: weights loaded by HF name reach generation
            sd = {n: p.detach().clone() * (1.5 if n.endswith("lm_head.weight") or "embed_tokens" in n else 1.0)
                  for n, p in hf.named_parameters()}
            worker = llm.llm_engine.model_executor.driver_worker.worker if hasattr(
                llm.llm_engine, "model_executor") else None
            if worker is not None:
                worker.model_runner.model.load_weights(weights=list(sd.items()))
                with torch.no_grad():
                    for n, p in hf.named_parameters():
                        p.copy_(sd[n])
                g2 = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=12),
                                  use_tqdm=False)[0].outputs[0]
                lg2 = logits(ids + list(g2.token_ids))
                check("A4 weights loaded by HF name reach generation",
                      list(g2.token_ids) == [int(torch.argmax(lg2[len(ids) - 1 + i])) for i in range(len(g2.token_ids))])
            else:
                print("SKIP A4: this vLLM version keeps the model in a separate process (V1 engine); OpenRLHF's "
                      "WorkerWrap.update_weight path is exercised by examples/cluster/smoke.sh check 2")
        del llm
        torch.cuda.empty_cache()
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
