"""Stand-in."""

from _missing import unavailable

all_gather = unavailable("flash_attn.utils.distributed.all_gather")
