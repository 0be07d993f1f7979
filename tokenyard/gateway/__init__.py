"""The HTTP gateway: one OpenAI-compatible chat endpoint in front of the engines.

The request path, in order (docs/architecture.md): http (parse) -> auth (key) -> routing (policy and
route) -> spend (budget) -> admission (reserve limits, admit) -> backends (engine) -> http (stream).
The shared state is built once in state.py."""
