"""The Plan: compile a validated spec once into plan.json (segments, models, dataflow, the per-step schedule) and explain it."""
