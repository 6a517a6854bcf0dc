"""A learned critic: a value model V(s_t) trained next to the policy (PPO, Schulman et al. 2017; as in OpenRLHF and
InstructGPT, Ouyang et al. 2022). Its settings are `ppo.critic`; its runtime (`ValueModel`) holds the network, its
own AdamW state and step count, all kept in checkpoints, so a resumed run continues it bit for bit.

Layout (composer/batch.py): values[b, t] = V(tokens[b, :t]), the value of the state *before* token t, read off the
scalar head at position t - 1 (0 at t = 0), as OpenRLHF's CriticModel reads `values[:, :-1]` at the action
positions. Two networks:
  own     its own network (default): a sequence-regression model (a transformers *ForSequenceClassification with one
          output, head `score`), from `model`, or when `model` is not set initialised from the policy's weights
          when the critic is first used (the backbone copied, a fresh scalar head; OpenRLHF's default critic is the
          actor's checkpoint with a new `score` head). Trained by its own optimizer on the value loss.
  shared  a scalar head on the policy's own network (TRL's old value-head model): the value loss joins the policy's
          loss times `value_coef`, so its gradient reaches the shared network; the head has its own AdamW.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from composer.contract import Runtime
from composer.lazy import torch
from composer.registry import NumbersNotBooleans


class Critic(NumbersNotBooleans, BaseModel):
    """The value model of a `ppo` objective: which network, how it learns, how its loss is clipped."""

    model_config = ConfigDict(extra="forbid")

    network: Literal["own", "shared"] = Field("own", description="own: a value model with its own weights (a sequence-regression checkpoint, by default initialised from the policy's weights with a fresh scalar head, as OpenRLHF's critic); shared: a scalar head on the policy's own network, the value loss added to the policy's loss times value_coef (Lightning only).")
    model: Optional[str] = Field(None, description="network own: the value model's checkpoint (id, directory or toy name; a causal LM gets a fresh scalar head, a *ForSequenceClassification with one output keeps its head). Not set: the policy's weights when the critic is first used.")
    lr: Optional[float] = Field(None, gt=0, allow_inf_nan=False, description="The critic's peak learning rate (AdamW; warm-up and decay follow train's program). Not set: train.lr (OpenRLHF's own default is 9e-6 against the actor's 1e-6).")
    value_clip: Optional[float] = Field(0.2, gt=0, allow_inf_nan=False, description="eps_v of the clipped value loss 0.5 max((V - G)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - G)^2) (recipe 0.2; OpenRLHF 0.5, TRL 0.2); null: the plain 0.5 (V - G)^2.")
    value_coef: float = Field(0.1, gt=0, allow_inf_nan=False, description="network shared: the value loss's weight in the policy's loss (TRL vf_coef 0.1). An own network is trained by its own optimizer and reads no coefficient.")
    trust_remote_code: bool = Field(False, description="Allow the critic checkpoint's own Python code to run when it loads (off: such a model is refused).")

    @property
    def separate(self) -> bool:
        """Trained by its own optimizer on its own loss (an own network), not inside the policy's loss."""
        return self.network == "own"

    def describe(self) -> str:
        """The critic in words (explain)."""
        clip = "no value clip" if self.value_clip is None else f"value clip {self.value_clip:g}"
        lr = "train.lr" if self.lr is None else f"lr {self.lr:g}"
        if self.network == "shared":
            return f"critic: a scalar head on the policy's network, value loss x {self.value_coef:g} in the policy's loss; head {lr}; {clip}"
        start = "the policy's weights (first use) + a fresh scalar head" if self.model is None else self.model
        return f"critic: its own value model from {start}, own AdamW {lr}; {clip}"

    def reference_value_loss(self, V, G, old, mask) -> tuple:
        """The referee's value loss (DESIGN.md section 10), written again in float64: per token
        0.5 max((V - G)^2, (V_old + clip(V - V_old, -eps, eps) - G)^2) (0.5 (V - G)^2 without value_clip), the mean
        over the action tokens -> (value, d value / d V [B, T], bound [B, T]: where the clipped branch is the
        larger). V, G, old [B, T] float64, mask [B, T] bool."""
        import torch

        eps = self.value_clip
        unclipped = (V - G) ** 2
        if eps is None:
            tok, dtok, bound = 0.5 * unclipped, V - G, torch.zeros_like(mask)
        else:
            Vc = old + (V - old).clamp(-eps, eps)
            clipped = (Vc - G) ** 2
            bound = clipped > unclipped
            tok = 0.5 * torch.maximum(unclipped, clipped)
            dtok = torch.where(bound, (Vc - G) * ((V - old).abs() < eps), V - G)
        n = max(int(mask.sum()), 1)
        return float(tok[mask].sum()) / n, torch.where(mask, dtok / n, torch.zeros_like(dtok)), bound

    def build(self, ctx, name: str) -> "ValueModel":
        return ValueModel(self, ctx, name)


class ValueModel(Runtime):
    """A critic in a run: the network (own) or the head on the policy (shared), its AdamW and its update count."""

    def __init__(self, cfg: Critic, ctx, name: str):
        self.cfg, self.name = cfg, name
        device = next(ctx.policy.parameters()).device
        seed = int(ctx.spec.train.seed)
        if cfg.network == "own":
            self.net = ctx.value_model(cfg.model, ctx.spec.policy.dtype, cfg.trust_remote_code, seed).to(device)
            self.head = None
        else:
            self.net = None
            self.head = ctx.value_head(seed).to(device)
        self.net_or_head.train()
        t = ctx.spec.train
        self.opt = torch.optim.AdamW(self.net_or_head.parameters(), lr=self.base_lr(ctx), betas=tuple(t.betas),
                                     weight_decay=t.weight_decay)
        self.updates = 0

    @property
    def separate(self) -> bool:
        """Trained on its own (an own network) rather than through the policy's loss (a head on its network)."""
        return self.net is not None

    @property
    def net_or_head(self):
        return self.net if self.net is not None else self.head

    def base_lr(self, ctx) -> float:
        return float(self.cfg.lr if self.cfg.lr is not None else ctx.spec.train.lr)

    # ---- values ----
    def values(self, ctx, batch, grad: bool = False, policy=None):
        """[B, T] V(tokens[b, :t]) at every position t (0 at t = 0): a forward of the own network, or of the policy's
        network (`policy`, the module the step trains) and the head. With `grad`, differentiable."""
        ids, mask = batch.tokens, batch.attention_mask
        if not grad:  # old values: a forward in eval mode (no dropout), as the recorded weights read
            self.net_or_head.eval()
        with torch.set_grad_enabled(grad):
            if self.net is not None:
                v = ctx.token_scores(self.net, ids, mask)  # [B, T]: the head at every position
            else:
                h = ctx.last_hidden(policy if policy is not None else ctx.policy, ids, mask)  # [B, T, H]
                v = self.head(h.to(self.head.weight.device, self.head.weight.dtype)).squeeze(-1)  # [B, T]
        self.net_or_head.train()
        v = v.float().to(ids.device)
        return torch.cat([v.new_zeros(v.shape[0], 1), v[:, :-1]], dim=1)  # [B, T]: position t reads the head at t - 1

    # ---- learning ----
    def step(self, ctx) -> dict[str, float]:
        """One optimizer step of the critic on the gradients its loss left (the own network: its value loss; shared:
        the head's part of the policy's loss): the gradient-norm clip of train.grad_clip, the Plan's LR program."""
        params = [p for p in self.net_or_head.parameters() if p.grad is not None]
        out = {}
        if ctx.data.world > 1:  # the critic is no DDP module: average its gradients over the ranks
            for p in params:
                torch.distributed.all_reduce(p.grad)
                p.grad /= ctx.data.world
        if params:
            clip = ctx.spec.train.grad_clip
            norm = torch.nn.utils.clip_grad_norm_(params, clip) if clip else torch.nn.utils.get_total_norm(
                [p.grad for p in params])
            out["critic/grad_norm"] = float(norm)
        lr = self.base_lr(ctx) * ctx.lr_scale()
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.updates += 1
        out["critic/lr"] = lr
        return out

    def state_dict(self) -> dict:
        return {"weights": {k: v.detach().clone() for k, v in self.net_or_head.state_dict().items()},
                "optimizer": self.opt.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.net_or_head.load_state_dict(state["weights"])
        self.opt.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])
