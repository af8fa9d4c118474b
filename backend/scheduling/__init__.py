"""Which requests run each step (`scheduler`) and the paged KV cache they hold (`kv_cache_manager`,
its block pool and KV cache groups)."""
