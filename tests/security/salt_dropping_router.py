"""A custom router (loaded with --router-class) whose translate_request builds its own engine
request without the request's cache_salt, as one written against MLC's models would: the
router's helpers keep the tenant's prefix-cache scope anyway (test_tenant_isolation.py)."""

from collections.abc import AsyncGenerator
from typing import Any

from router import Router
from router import microserving_protocol as microserving_entrypoints
from router import openai_protocol as openai_api_protocol


class SaltDroppingRouter(Router):
    async def translate_request(
        self, request: openai_api_protocol.CompletionRequest, request_id: str
    ) -> AsyncGenerator[openai_api_protocol.CompletionResponse | None, Any]:
        request.user = request_id
        start = microserving_entrypoints.StartGenerateRequest(
            **request.model_dump(exclude={"cache_salt"}), begin=0
        )
        async for response in self.send_start_generate(None, start, self.server_urls[0]):
            yield response


class IdRenamingSaltDroppingRouter(Router):
    """The same, and its engine call goes under a request id of its own making (not the one
    the runner passed in)."""

    async def translate_request(
        self, request: openai_api_protocol.CompletionRequest, request_id: str
    ) -> AsyncGenerator[openai_api_protocol.CompletionResponse | None, Any]:
        request.user = f"{request_id}-mine"
        start = microserving_entrypoints.StartGenerateRequest(
            **request.model_dump(exclude={"cache_salt"}), begin=0
        )
        async for response in self.send_start_generate(None, start, self.server_urls[0]):
            yield response
