"""Whether and when a request runs: rate limits in Redis, the gatekeeper, fair queues per engine,
and the shedding rule."""
