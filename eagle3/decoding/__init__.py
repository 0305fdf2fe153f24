"""Speculative decoding against the target, in this process: the drafters and the loop.

decoder: the loop (SpeculativeDecoder: draft, verify in one target forward, accept, roll the
caches back; plain_generate, the reference) and the Drafter interface it drives. decode_config:
DecodeConfig (chain or tree, sizes, temperature). tree: DraftTree and the T=0 / T>0 rules that
accept a path through it. acceptance: AcceptanceStats (tau, alpha_i, per-step contexts). The
drafters, one module each: eagle (EagleDrafter: an EAGLE-3 draft as a chain or an EAGLE-2 tree),
prompt_lookup (PromptLookupDrafter: no model). A method whose drafter is its own keeps it in
its package (P-EAGLE's ParallelDrafter: eagle3/methods/p_eagle/decoding.py, built on eagle and
tree). Nothing here is imported by checkpoint loading or training.
"""
