"""The engine's floor: types and state machines that import nothing else of engines/. Errors,
configs, sampling params, sequences, outputs, the KV block pool and manager, the scheduler, the
request inbox, structured-output grammars and the backend interface the gateway drives. The engine
that steps them is one floor up at the top (tokenyard.engines.runtime)."""
