"""HTTP APIs over the whole Gateway (tokenyard/gateway/state.py): the policy admin API and the spend API.

They sit above state.py, which imports only downward (policy/, spend/, routing/ hold the lower parts)."""
