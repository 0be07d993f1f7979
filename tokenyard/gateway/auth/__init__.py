"""Who is calling: API keys and their cache, browser sessions and CSRF tokens."""
