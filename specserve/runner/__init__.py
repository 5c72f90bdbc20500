"""Layer 3: ForwardBatch -> logits and features. model_runner.py owns the model, its KV pool
and backend; cuda_graph.py (the one capture helper) and prefill_graphs.py replay graphs;
sampler.py samples; memory.py sizes the KV budget."""
