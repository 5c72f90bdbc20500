"""Text in and out: the tokenizer and chat template (tokenizer.py), streaming detokenization
and stop strings (streaming.py). Below the engine: nothing here knows models or requests."""
