"""Layer 0: the types every other layer shares, and the configuration.

config.py (frozen dataclasses per subsystem, ConfigError), env.py (every environment
variable), request.py / sampling_params.py / messages.py (a request and what crosses the
process boundary), batch.py (ScheduleBatch) and forward_batch.py (ForwardBatch), h2d.py
(host-to-device copies), rope.py (rotary tables at a forward's positions). Nothing here
imports another specserve package.
"""
