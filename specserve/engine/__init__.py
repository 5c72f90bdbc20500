"""Layer 4: the engine. scheduler.py (continuous batching), kv_manager.py (request-level KV),
output.py (finish conditions), overlap.py (overlapped plain steps), process.py and
client.py (the engine's own process and the front end's handle on it), speculation.py
(all the engine knows of speculative decoding), protocol.py (the front end's view)."""
