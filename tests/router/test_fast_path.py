"""The built-in patterns' fast path (engine ChoiceDelta protos relayed as they are, from the
engine's multiplexed stream or from StartGenerate) streams exactly what the programmable path (translate_request -> CompletionResponse) streams; the
outbox relays engine deltas unchanged and merges only what queued; the engines get the same
sampling values either way; the read watchdog times reads, not the consumer."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc
import pytest
from router_stack import greedy, router_settings, running_router

from microserving.v1 import common_pb2, router_pb2, router_pb2_grpc
from router import Router
from router.deadlines import StageDeadline
from router.microserving_protocol import StartGenerateRequest
from router.openai_proto import engine_sampling, request_to_sampling, sampling_to_request_fields
from router.openai_protocol import CompletionRequest, CompletionResponse
from router.outbox import Outbox

_ids = itertools.count()


class ThroughTranslateRequest(Router):
    """Overrides translate_request (delegating to the built-in one), so the runner must take the
    programmable path: CompletionResponse chunks, converted back to protos."""

    async def translate_request(
        self, request: CompletionRequest, request_id: str
    ) -> AsyncGenerator[CompletionResponse | None, Any]:
        async for response in super().translate_request(request, request_id):
            yield response


class LoggingStartGenerate(Router):
    async def send_start_generate(  # type: ignore[override]
        self, session: Any, request: StartGenerateRequest, server_url: str
    ) -> AsyncIterator[CompletionResponse]:
        async for response in super().send_start_generate(session, request, server_url):
            yield response


def test_only_routers_that_override_nothing_take_the_fast_path() -> None:
    settings = router_settings(["127.0.0.1:1=both"])
    assert Router(settings=settings).uses_builtin_patterns
    assert not ThroughTranslateRequest(settings=settings).uses_builtin_patterns
    assert not LoggingStartGenerate(settings=settings).uses_builtin_patterns


async def _stream(stub: router_pb2_grpc.RouterStub, *requests: router_pb2.NewRequest) -> dict[str, dict[str, Any]]:
    """Every event per request, with deltas concatenated (their split may differ)."""
    out: dict[str, dict[str, Any]] = {
        r.request_id: {"ids": {}, "text": {}, "logprobs": {}, "logprob_values": {}, "finish": {}, "first": None} for r in requests
    }

    async def messages() -> AsyncIterator[router_pb2.GenerateRequest]:
        for request in requests:
            yield router_pb2.GenerateRequest(generate=request)

    async for message in stub.Generate(messages(), timeout=120):
        seen = out[message.request_id]
        kind = message.WhichOneof("event")
        seen["first"] = seen["first"] or kind
        if kind == "delta":
            d = message.delta
            seen["ids"].setdefault(d.index, []).extend(d.token_ids)
            seen["text"][d.index] = seen["text"].get(d.index, "") + d.text
            # Values compared apart, with a tolerance: two engines batch differently. The
            # pydantic models carry no token_id on top_logprobs, so it is left out.
            seen["logprobs"].setdefault(d.index, []).extend(
                (lp.token_id, lp.token, lp.token_bytes, [(t.token, t.token_bytes) for t in lp.top_logprobs])
                for lp in d.logprobs)
            seen["logprob_values"].setdefault(d.index, []).extend(
                v for lp in d.logprobs for v in (lp.logprob, *(t.logprob for t in lp.top_logprobs)))
        elif kind == "finish":
            seen["finish"][message.finish.index] = message.finish.reason
        elif kind == "done":
            seen["usage"] = message.done.usage.SerializeToString()
            seen["engines"] = list(message.done.engines)
        elif kind == "prompt":
            seen["prompt"] = message.prompt.SerializeToString()
        elif kind == "error":
            seen["error"] = (message.error.code, message.error.param)
    return out


def _requests(tag: str) -> list[router_pb2.NewRequest]:
    # Each prompt starts with its request's own name: no two share a prefix-cache page, so
    # cached_tokens (in usage) cannot depend on which request an engine finished first.
    prompt = f"[{tag}] The fast path must relay what the slow path relays, token for token."
    return [_own_prefix(r) for r in _requests_sharing_a_prompt(prompt)]


def _own_prefix(request: router_pb2.NewRequest) -> router_pb2.NewRequest:
    request.text = f"({request.request_id}) {request.text}"
    return request


def _requests_sharing_a_prompt(prompt: str) -> list[router_pb2.NewRequest]:
    return [
        router_pb2.NewRequest(request_id="plain", text=prompt, sampling=greedy(16)),
        router_pb2.NewRequest(request_id="logprobs", text=prompt + " Again.", echo=True,
                              sampling=greedy(8, logprobs=True, top_logprobs=2)),
        router_pb2.NewRequest(request_id="stop", text=prompt, sampling=greedy(16, stop=["e"])),
        router_pb2.NewRequest(request_id="n2", text=prompt + " Twice.",
                              sampling=common_pb2.SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=6)),
        router_pb2.NewRequest(request_id="bad", text=prompt, sampling=common_pb2.SamplingParams(temperature=9.0)),
    ]


@pytest.mark.integration
@pytest.mark.parametrize("pattern", ["round-robin", "disagg"])
@pytest.mark.parametrize("engine_stream", [True, False], ids=["engine-stream", "start-generate"])
async def test_fast_path_streams_what_translate_request_streams(shims, pattern: str, engine_stream: bool) -> None:
    """Both fast paths (decode on the engine's multiplexed stream, or a StartGenerate call
    per request) stream what the programmable path streams."""
    roles = ["both", "both"] if pattern == "round-robin" else ["prefill", "decode"]
    requests = _requests(f"{pattern}-{next(_ids)}")
    seen = []
    # Each router gets engines of its own, so both meet cold prefix caches (same cached_tokens).
    for router_class, pair in ((Router, shims[:2]), (ThroughTranslateRequest, shims[2:4])):
        engines = [f"{shim.address}={role}" for shim, role in zip(pair, roles, strict=True)]
        router = router_class(settings=router_settings(engines, pattern=pattern, engine_stream=engine_stream))
        async with running_router(router) as (_, stub):
            seen.append(await _stream(stub, *requests))
    fast, programmable = seen
    for name in ("plain", "logprobs", "stop", "n2"):
        got, want = fast[name], programmable[name]
        assert "error" not in got and got["first"] in ("delta", "prompt"), name
        for key in ("ids", "text", "logprobs", "finish", "prompt"):
            assert got.get(key) == want.get(key), (name, key)
        # Where P samples the first token (disagg on the engine's stream, n = 1), D receives
        # the whole prompt's KV: one position more than MLC's window, the rest of usage equal.
        got_usage, want_usage = (common_pb2.Usage.FromString(seen_[name]["usage"]) for seen_ in (fast, programmable))
        samples_first = pattern == "disagg" and engine_stream and name != "n2"
        assert got_usage.kv_transferred_tokens == want_usage.kv_transferred_tokens + samples_first, name
        got_usage.kv_transferred_tokens = want_usage.kv_transferred_tokens
        assert got_usage == want_usage, name
        for index, values in want["logprob_values"].items():
            assert got["logprob_values"][index] == pytest.approx(values, abs=1e-3), name
        assert len(got["engines"]) == len(want["engines"]), name
    assert fast["bad"]["error"] == programmable["bad"]["error"] == (
        grpc.StatusCode.INVALID_ARGUMENT.value[0], "sampling.temperature")
    assert len(fast["logprobs"]["logprobs"][0]) == len(fast["logprobs"]["ids"][0]) > 0


def _delta(index: int, ids: list[int], text: str, reason: int = 0) -> common_pb2.ChoiceDelta:
    logprobs = [common_pb2.TokenLogprob(token_id=i, logprob=-float(i)) for i in ids]
    return common_pb2.ChoiceDelta(index=index, token_ids=ids, text=text, logprobs=logprobs,
                                  finish_reason=reason)  # type: ignore[arg-type]


async def test_engine_deltas_go_out_unchanged_and_queued_ones_merge_in_order() -> None:
    outbox = Outbox()
    first_in = _delta(0, [1], "a")
    outbox.put_choice_delta("r", first_in)
    first_batch = await outbox.take()  # the first delta is out before any other arrives
    assert first_batch is not None and len(first_batch.responses) == 1
    first = first_batch.responses[0]
    assert first.delta == first_in and first.request_id == "r"
    engine_messages = [_delta(0, [2], "b"), _delta(1, [9], "x"), _delta(0, [3, 4], "cd"),
                       _delta(0, [5], "e", common_pb2.FINISH_REASON_LENGTH), _delta(0, [6], "late")]
    snapshots = [m.SerializeToString() for m in engine_messages]
    for message in engine_messages:  # the writer is busy: these queue
        outbox.put_choice_delta("r", message)
    batch = await outbox.take()  # everything queued meanwhile, in one message
    assert batch is not None
    out = list(batch.responses)
    assert len(out) == 3
    assert [m.SerializeToString() for m in engine_messages] == snapshots  # merging copies, never mutates
    merged, other, late = (m.delta for m in out)
    assert list(merged.token_ids) == [2, 3, 4, 5] and merged.text == "bcde"
    assert [lp.token_id for lp in merged.logprobs] == [2, 3, 4, 5]
    assert merged.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (other.index, list(other.token_ids)) == (1, [9])
    assert list(late.token_ids) == [6]  # nothing merges past a finish
    assert outbox.num_merged == 2  # [3, 4] and [5] into [2]


@pytest.mark.parametrize("sampling", [
    common_pb2.SamplingParams(),
    common_pb2.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    common_pb2.SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3, n=3, stop=["a", "bc"],
                              stop_token_ids=[2], frequency_penalty=0.5, presence_penalty=-0.5,
                              logit_bias={4: 2.5}, logprobs=True, top_logprobs=3, cache_salt="tenant-x"),
    common_pb2.SamplingParams(logprobs=False, top_logprobs=4, max_tokens=1),
])
def test_engines_get_the_sampling_values_of_the_pydantic_round_trip(sampling: common_pb2.SamplingParams) -> None:
    original = sampling.SerializeToString()
    fields = sampling_to_request_fields(sampling)
    via_pydantic = request_to_sampling(CompletionRequest.model_validate({**fields, "prompt": [1, 2]}))
    assert engine_sampling(sampling) == via_pydantic
    assert engine_sampling(sampling, max_tokens=2).max_tokens == 2
    assert sampling.SerializeToString() == original


class _Call:
    def __init__(self) -> None:
        self.is_cancelled = False

    def cancel(self) -> bool:
        self.is_cancelled = True
        return True


async def test_stage_deadline_cancels_a_stalled_read_but_not_a_busy_consumer() -> None:
    call = _Call()
    watchdog = StageDeadline(0.05, 0.05, call.cancel)
    watchdog.waiting()
    watchdog.arrived()  # a message came; the consumer now takes its time
    await asyncio.sleep(0.2)
    assert not call.is_cancelled and not watchdog.has_expired
    watchdog.waiting()
    for _ in range(100):
        if call.is_cancelled:
            break
        await asyncio.sleep(0.02)
    assert call.is_cancelled and watchdog.has_expired
    watchdog.stop()
