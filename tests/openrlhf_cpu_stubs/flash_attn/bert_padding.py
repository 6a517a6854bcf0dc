"""Stand-in."""

from _missing import unavailable

index_first_axis = unavailable("flash_attn.bert_padding.index_first_axis")
pad_input = unavailable("flash_attn.bert_padding.pad_input")
unpad_input = unavailable("flash_attn.bert_padding.unpad_input")
rearrange = unavailable("flash_attn.bert_padding.rearrange")
