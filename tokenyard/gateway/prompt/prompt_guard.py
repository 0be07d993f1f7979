"""Keep prompts from holding the event loop: a size cap before any template runs, tokenisation on
threads, and refusals that still count against the sender's request limit.

    check_prompt_size(gw, req, "messages")       # 400 context_length_exceeded, no tokenising
    ids = await off_loop(tokenize, tok, messages) # chat template + encode on the prompt threads
    await charge_refused(gw, key)                 # a refused prompt still uses one request

The cap: a token is at least one character, and real text averages about four; no prompt of more
than PROMPT_CHARS_PER_TOKEN (16: four characters a token, times a margin of four) characters per
token of the largest context it may be served with can fit, so it is refused before the chat
template or the tokenizer sees it. The characters counted are the prompt's own text (message
contents, names, tool-call arguments; the tools' names, descriptions and parameter schemas; a text
completion's prompt), never the JSON around them; the template only adds to them. A prompt that
averages more than 16 characters a token (long runs of one repeated character) is refused though
it might fit: a price for never tokenising a megabyte that cannot. Measured before: a ~1 MB body
(100 tools with 1,200-word descriptions) cost ~1.1 s of event-loop time to template and tokenise
and ended as context_length_exceeded anyway.

Threads: HF tokenizers encodes in Rust, and the chat template is Python that gives the GIL back
every switch interval (server.gil_switch_interval_ms), so /health and the streams keep their turns
while a prompt under the cap is tokenised (tokenyard/bench/hostile_requests.py measures it). PROMPT_THREADS
threads: more would only share the same cores.

Refusals: a prompt refused for its length (here, or once tokenised: context_length_exceeded)
takes one request from the sender's rate limit and no tokens, so a flood of them is limited like
any other (429) instead of being free.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from tokenyard.gateway.edge.chat_request import ChatRequest
from tokenyard.gateway.edge.errors import BadRequest

if TYPE_CHECKING:
    from tokenyard.gateway.auth.api_keys import KeyRecord
    from tokenyard.gateway.edge.completion_request import CompletionRequest
    from tokenyard.gateway.state import Gateway

PROMPT_CHARS_PER_TOKEN = 16
PROMPT_THREADS = 2
# A prompt of at most this many characters is templated and encoded on the event loop: that takes
# tens of microseconds, less than handing it to a thread and back (a queue put, a wake-up, a
# call_soon_threadsafe), which a short chat pays two to four times per request.
INLINE_PROMPT_CHARS = 2048
_pool: ThreadPoolExecutor | None = None
T = TypeVar("T")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on the prompt threads (templating, tokenising)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=PROMPT_THREADS, thread_name_prefix="tokenyard-prompt")
    return await asyncio.get_running_loop().run_in_executor(_pool, fn, *args)


async def prompt_work(req: "ChatRequest | CompletionRequest", fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), work on this request's prompt: inline for a short prompt, else on the prompt threads."""
    chars = req.prompt_chars if req.prompt_chars is not None else prompt_chars(req)
    if not isinstance(req, ChatRequest) and len(req.prompts) > 1:    # a batch of prompts: all of them
        chars = sum(len(p) for p in req.prompts)
    if chars <= INLINE_PROMPT_CHARS:
        return fn(*args)
    return await off_loop(fn, *args)


def text_chars(value: Any) -> int:
    """Characters of every string (and object key) in a JSON value."""
    total = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            total += sum(len(k) for k in v if isinstance(k, str))
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total


def prompt_chars(req: "ChatRequest | CompletionRequest") -> int:
    """The longest prompt's own text, in characters (token-id prompts count their ids: exact)."""
    if isinstance(req, ChatRequest):
        n = text_chars(req.messages)
        if req.tools is not None:
            n += sum(len(t.name) + len(t.description) + text_chars(t.parameters) for t in req.tools.tools)
        return n
    return max(len(p) for p in req.prompts)


def max_context(gw: "Gateway", model: str) -> int:
    """The largest context the request may be served with: the named engine's, or any engine's."""
    if model in gw.handles:
        return gw.handles[model].engine.max_model_len
    return max(h.engine.max_model_len for h in gw.handles.values())


def check_prompt_size(gw: "Gateway", req: "ChatRequest | CompletionRequest", param: str) -> None:
    """400 context_length_exceeded for a prompt too long for any context, before it is templated."""
    context = max_context(gw, req.model)
    chars = req.prompt_chars = prompt_chars(req)
    if chars > context * PROMPT_CHARS_PER_TOKEN:
        raise BadRequest(f"This model's maximum context length is {context} tokens; the {param} have {chars} "
                         f"characters, more than {PROMPT_CHARS_PER_TOKEN} per token of that context, and were "
                         f"not tokenised", param=param, code="context_length_exceeded")


UNROUTED = "(unrouted)"   # the engine label of a request refused before it was routed to one


async def charge_refused(gw: "Gateway", key: "KeyRecord", engine: str) -> None:
    """Count one request (no tokens) for a prompt refused for its length; RateLimited (429) when the
    sender is over its request limit, which then answers instead of the 400."""
    state = gw.policy
    rate = state.rate_for(key.tenant) if state.policy is not None else None
    await gw.gatekeeper.limiter.reserve(key, 0, engine, rate)
