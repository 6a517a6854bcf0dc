"""Tasks: verifiers and the toy testbed.

The toy testbed's parts are registered by name (composer.registry.register_part): the runtime, the
backends and the CLI look them up with `part(name)` and never import this package; each module is
imported only when its part is used (toy.py and bootstrap.py import torch and transformers).
"""

from components.tasks import code_verifier, verifiers  # noqa: F401
from composer.registry import register_part

register_part("toy.task", "components.tasks.toy:toy_task")  # toy_task(tiers, train_tiers, ...) -> Task
register_part("toy.write_jsonl", "components.tasks.toy:write_jsonl")  # the toy data as jsonl files
register_part("toy.templates", "components.tasks.toy:TEMPLATES")  # the toy task's teacher / judge templates
register_part("toy.max_new_tokens_for", "components.tasks.toy:max_new_tokens_for")  # response cap of a tier
register_part("toy.checkpoints", "components.tasks.bootstrap:ensure_checkpoints")  # {name: path}, built once
register_part("toy.cache_folder", "components.tasks.bootstrap:cache_folder")  # where the checkpoints live
register_part("toy.specials", "components.tasks.tokenizer:SPECIALS")  # its control tokens (<eos>, <bos>, ...)
