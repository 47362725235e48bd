"""MLC-LLM's MicroServing tutorial router, on this project's gRPC router.

Only the import lines differ from the tutorial: a Router subclass overrides translate_request
and runs prefill-decode disaggregation by hand with the three MicroServing calls (engine 0
prefills, engine 1 decodes). The aiohttp session is the tutorial's; our helpers accept it and
use the router's pooled gRPC channels instead.

Run: python examples/custom_router.py   (then POST to http://127.0.0.1:9123/v1/completions)
"""

from collections.abc import AsyncGenerator
from typing import Any

import aiohttp

from router import Router, serve
from router import microserving_protocol as microserving_entrypoints
from router import openai_protocol as openai_api_protocol


class CustomRouter(Router):
    async def translate_request(
        self, request: openai_api_protocol.CompletionRequest, request_id: str
    ) -> AsyncGenerator[openai_api_protocol.CompletionResponse | None, Any]:
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=3 * 3600), trust_env=True
        ) as session:
            # The decode engine computes only the last prompt token itself.
            decode_start = len(request.prompt) - 1

            # 1. Ask the decode engine (engine 1) to reserve KV slots for prompt[:decode_start].
            prep_recv_request = microserving_entrypoints.PrepRecvRequest(
                **request.model_dump(), end=decode_start
            )
            kv_addr_info, prefix_matched_length = await self.send_prepare_receive(
                session=session, request=prep_recv_request, server_url=self.server_urls[1]
            )

            # 2. The prefill engine (engine 0) computes the KV of
            #    prompt[prefix_matched_length:decode_start] and writes it into those slots;
            #    nothing to send when the decode engine already caches that window.
            if prefix_matched_length < decode_start:
                remote_send_request = microserving_entrypoints.RemoteSendRequest(
                    **request.model_dump(),
                    begin=prefix_matched_length,
                    end=decode_start,
                    kv_addr_info=kv_addr_info,
                    recv_rank=self.device_id_starts[1],
                )
                await self.send_remote_send(
                    session=session, request=remote_send_request, server_url=self.server_urls[0]
                )

            # 3. The decode engine prefills the last token and streams the generation.
            start_generate_request = microserving_entrypoints.StartGenerateRequest(
                **request.model_dump(), begin=decode_start
            )
            async for response in self.send_start_generate(
                session=session, request=start_generate_request, server_url=self.server_urls[1]
            ):
                if len(response.choices) > 0 and response.choices[0].finish_reason == "preempt":
                    yield None  # preempted: the router runs the request again
                yield response


if __name__ == "__main__":
    serve(
        model="tiny",  # or a local Hugging Face model directory
        model_lib=None,  # an MLC model lib selects the MLC backend
        router_host="127.0.0.1",
        router_port=9123,
        endpoint_hosts=["127.0.0.1", "127.0.0.1"],
        endpoint_ports=[9124, 9125],
        endpoint_num_gpus=[1, 1],
        enable_prefix_cache=False,
        router_type=CustomRouter,
    )
