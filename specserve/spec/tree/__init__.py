"""Draft-model tree drafting on the device, shared by STANDALONE and EAGLE.

draft.py expands EAGLE-2 trees (per-depth global top-k by path score, rerank to N-1 nodes)
with each branch attending to its own ancestors through a per-branch tail of scratch slots;
graphs.py captures a whole drafting pass as one CUDA graph; extend_graphs.py the draft
extend over committed tokens; root_states.py keeps each request's root state on the
device between steps; rows.py is the pass's row bookkeeping (a kernel on CUDA).
"""
