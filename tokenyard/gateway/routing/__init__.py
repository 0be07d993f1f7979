"""Which engine serves a request: the policy-and-route plan, the learned router, the interim rule."""
