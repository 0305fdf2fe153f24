"""EAGLE-3.1 (method "eagle3.1", arXiv 2605.09992): EAGLE-3 with its two switches on.

fc_norm (an RMSNorm per aux state before fc) and norm_output (the next step is fed the
post-norm state), both in eagle3.model (its docstring) and read by vLLM from the draft's
config.json, for GQA and MLA drafts. Everything else is EAGLE-3's (eagle3.py): the same draft
class, sub-config (eagle3.Eagle3Options, whose switches this method's defaults turn on), TTT
unroll and loss, export (the switches are top-level keys of every config.json) and drafter.
"""

from __future__ import annotations

from eagle3.methods.eagle3 import Eagle3Method


class Eagle31Method(Eagle3Method):
    name = "eagle3.1"
    switches = True
    reads_each_aux = True  # fc_norm normalises each aux state apart


EAGLE3_1 = Eagle31Method()
