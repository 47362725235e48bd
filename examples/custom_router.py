"""MLC-LLM's MicroServing tutorial router, on this project's gRPC router.

Only the import lines differ from the tutorial: a Router subclass overrides translate_request
and runs prefill-decode disaggregation by hand with the three MicroServing calls (engine 0
prefills, engine 1 decodes; remote_send always from 0, so the engines run without a prefix
cache, as the tutorial's enable_prefix_cache=False starts them). The aiohttp session is the tutorial's; our helpers accept it and
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
        # we will pass request_id as an argument in microserving API calls
        request.user = request_id

        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=3 * 3600), trust_env=True
        ) as session:
            decode_start = len(request.prompt) - 1
            # 1. Ask decode engine to prepare KV entries to receive from prefill engine
            prep_recv_request = microserving_entrypoints.PrepRecvRequest(
                **request.model_dump(), end=decode_start
            )
            (
                kv_addr_info,
                _,
            ) = await self.send_prepare_receive(
                session=session,
                request=prep_recv_request,
                server_url=self.server_urls[1],  # engine 0 is prefill, engine 1 is decode
            )
            # 2. Ask prefill engine to send KV to decode engine. Always from 0, as the
            #    tutorial does: that needs enable_prefix_cache=False (serve() below), under
            #    which prep_recv never reports a cached prefix.
            remote_send_request = microserving_entrypoints.RemoteSendRequest(
                **request.model_dump(),
                begin=0,
                end=decode_start,
                kv_addr_info=kv_addr_info,
                recv_rank=self.device_id_starts[1],  # the rank of decode engine
            )
            await self.send_remote_send(
                session=session,
                request=remote_send_request,
                server_url=self.server_urls[0],  # prefill engine
            )
            # 3. Start decoding
            start_generate_request = microserving_entrypoints.StartGenerateRequest(
                **request.model_dump(),
                begin=decode_start,
            )
            async for response in self.send_start_generate(
                session=session,
                request=start_generate_request,
                server_url=self.server_urls[1],
            ):
                if len(response.choices) > 0:
                    finish_reason = response.choices[0].finish_reason
                    if finish_reason == "preempt":
                        yield None
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
