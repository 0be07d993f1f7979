"""The request flow of the OpenAI endpoints: chat and text completions from the parsed request
through the route plan, admission and the engine to the reply or its stream (completion_flow.py),
tool calls parsed from the model's text. Below it: edge/ (errors, parameters, request bodies),
prompt/ (templating, tools, trimming); above it: server/ (the app and the server)."""
