"""KV blocks that leave the engine: hand-over between engines (connector + transports) and the
second cache tier below the KV pool (host memory, then local disk). docs/kv_transfer.md."""
