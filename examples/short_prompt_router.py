"""A custom orchestration pattern, deployable with `--router-class`: short prompts skip
disaggregation (the decode engine prefills them itself: one start_generate), longer ones go
prefill -> decode, reusing whatever prefix the decode engine already caches.

    microserving up --router-class examples/short_prompt_router.py:ShortPromptRouter
    microserving router --router-class short_prompt_router:ShortPromptRouter \\
        --engine P=prefill --engine D=decode          # with examples/ on PYTHONPATH

Engines in the router's order: the first is the prefill engine, the last the decode engine.
"""

from collections.abc import AsyncGenerator
from typing import Any

from router import Router
from router import microserving_protocol as microserving_entrypoints
from router import openai_protocol as openai_api_protocol

# Below this many prompt tokens a KV transfer costs more than the decode engine's own prefill.
SHORT_PROMPT_TOKENS = 32


class ShortPromptRouter(Router):
    async def translate_request(
        self, request: openai_api_protocol.CompletionRequest, request_id: str
    ) -> AsyncGenerator[openai_api_protocol.CompletionResponse | None, Any]:
        request.user = request_id
        prefill_url, decode_url = self.server_urls[0], self.server_urls[-1]
        begin = 0
        if len(request.prompt) >= SHORT_PROMPT_TOKENS:
            begin = len(request.prompt) - 1  # the decode engine computes the last token
            kv_addr_info, matched = await self.send_prepare_receive(
                session=None,
                request=microserving_entrypoints.PrepRecvRequest(**request.model_dump(), end=begin),
                server_url=decode_url,
            )
            if matched < begin:
                await self.send_remote_send(
                    session=None,
                    request=microserving_entrypoints.RemoteSendRequest(
                        **request.model_dump(), begin=matched, end=begin,
                        kv_addr_info=kv_addr_info, recv_rank=self.device_id_start(decode_url),
                    ),
                    server_url=prefill_url,
                )
        start = microserving_entrypoints.StartGenerateRequest(**request.model_dump(), begin=begin)
        async for response in self.send_start_generate(None, start, decode_url):
            if response.choices and response.choices[0].finish_reason == "preempt":
                yield None
            yield response
