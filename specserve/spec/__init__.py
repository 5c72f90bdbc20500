"""Speculative decoding: propose -> verify -> accept -> commit, for every algorithm.

The core, the same for every proposer: drafts.py (the one tree structure), verify.py and
accept.py (one verify forward, one accept rule), worker.py (a step, and the engine's
`Speculator`), governor.py (speculate or decode plainly, by measured cost), pipeline.py
(steps left in flight), proposer.py (what a proposer implements), registry.py (the
algorithms, by name: nothing outside spec/ knows one), tree_rules.py and sources.py (the
tree triple's rules and a draft's path, used by the entries). Proposers: ngram/,
standalone/, eagle/; tree/ is the device tree drafting that STANDALONE and EAGLE share.
"""
