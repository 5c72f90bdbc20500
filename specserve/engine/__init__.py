"""Layer 4: the engine. scheduler.py (continuous batching), kv_manager.py (request-level KV),
output.py (finish conditions), overlap.py (overlapped plain steps), process.py and
fronts.py (the engine's own process and its pipes to the front ends), link.py and
client.py (a front end's handle on the engines; the launcher's owns their processes),
speculation.py (all the engine knows of speculative decoding), protocol.py (the front
end's view)."""
