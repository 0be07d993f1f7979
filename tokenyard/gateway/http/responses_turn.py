"""One Responses API request's turn of a conversation: the draft, the stored conversation of its
previous_response_id (the tenant's own only), the id it will be stored under, and the store write.
Shared by the endpoint (responses_endpoint.py), upstream engines' replies (responses_upstream.py)
and Batch API lines.
"""
from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING, Any

from tokenyard.gateway.edge.chat_request import ChatRequest
from tokenyard.gateway.edge.errors import APIError, NotFound
from tokenyard.gateway.edge.responses_request import ResponsesDraft
from tokenyard.gateway.http.responses_output import ResponseBuilder, output_messages
from tokenyard.gateway.store.response_store import ResponseStore

if TYPE_CHECKING:
    from tokenyard.gateway.state import Gateway

log = logging.getLogger(__name__)


class Turn:
    """One request's way to its reply: the draft, the conversation before it, where it is stored."""

    def __init__(self, gw: "Gateway", draft: ResponsesDraft, tenant: str, previous: list[dict[str, Any]]) -> None:
        self.draft = draft
        self.tenant = tenant
        self.previous = previous
        self.store = ResponseStore.of(gw)
        self.response_id = "resp_" + secrets.token_hex(24)

    def builder(self, model: str) -> ResponseBuilder:
        return ResponseBuilder(self.response_id, model, self.draft.echo)

    async def keep(self, builder: ResponseBuilder) -> None:
        """Store the finished response (store: true), never failing the reply."""
        if not self.draft.store:
            return
        entry = {"response": builder.response(),
                 "messages": self.draft.conversation(self.previous) + output_messages(builder.items)}
        try:
            await self.store.put(self.tenant, self.response_id, entry)
        except APIError as e:
            log.warning("response %s was not stored: %s", self.response_id, e.message)


async def open_turn(gw: "Gateway", draft: ResponsesDraft, tenant: str) -> tuple[ChatRequest, Turn]:
    """The chat request of a Responses body (an HTTP request's or a Batch API line's) and its turn:
    the stored conversation of previous_response_id (the tenant's own only) comes first."""
    previous: list[dict[str, Any]] = []
    if draft.previous_response_id is not None:
        stored = await ResponseStore.of(gw).get(tenant, draft.previous_response_id)
        if stored is None:
            raise NotFound(f"Previous response with id '{draft.previous_response_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        previous = stored["messages"]
    req = draft.chat_request(previous, gw.deployment.limits.max_messages)
    return req, Turn(gw, draft, tenant, previous)
