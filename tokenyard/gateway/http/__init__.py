"""The HTTP edge: the app, the server and its connection guard, the chat endpoint, request parsing,
edge parameters, streaming, errors, the OpenAPI document and the service endpoints."""
