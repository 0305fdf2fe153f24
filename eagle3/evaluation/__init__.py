"""The evaluation application: drafters measured against the target by real speculative
decoding, in this process (eagle3.decoding) or in a vLLM server (eagle3.engine).

run: one run of `python -m eagle3.evaluate` (its parser, the benchmarks, the drafters measured
on each; eagle3/evaluate.py is the command's entry point). measure: what is decoded and counted
(drafter specs and loading, the in-house Tally, the engine passes and their per-request counts).
statistics: intervals bootstrapped over prompts, acceptance by context position. report: result
rows, the markdown tables, the JSON and its W&B copy. side_by_side: `python -m eagle3.compare`
(eagle3/compare.py), reports side by side.
"""
