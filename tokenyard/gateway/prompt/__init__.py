"""Prompt rendering, one step before the route plan: the chat template with tools, the context
trim, the size cap and the prompt threads; it hands token ids to http/route_plan.py."""
