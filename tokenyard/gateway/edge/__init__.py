"""The gateway's floor: OpenAI-style errors, edge parameter parsing and the parsed request bodies
(chat, text completion, tools). Every other gateway folder may use it; it uses none of them."""
