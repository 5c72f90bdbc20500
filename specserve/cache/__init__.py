"""Layer 1: KV memory. kv_pool.py (per-layer K/V by token slot, the slot allocator),
req_table.py (request row x position -> slot), radix.py (prefix sharing, LRU eviction)."""
