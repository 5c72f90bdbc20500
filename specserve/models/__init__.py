"""Layer 2: model files and where their weights come from. llama.py is the Llama family as
one file; eagle.py, eagle3.py, mtp.py the draft heads; source.py, catalogue.py, gguf*.py
and loader.py turn a --model string into a loaded model. No serving logic here."""
