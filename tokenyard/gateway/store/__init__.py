"""Redis plumbing: the guard every request-path call goes through, and the embedded server."""
