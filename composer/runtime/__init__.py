"""Backend-agnostic runtime pieces (they import torch): model loading, rollout engines, the run context."""
