"""The engine core: requests and sequences, KV block pool and manager, scheduler, the engine step,
the offline LLM and the async engine, and the backend interface the gateway drives."""
