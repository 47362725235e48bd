"""The microserving.v1 contract, exercised before any engine exists.

Every message type is built with every field set and round-tripped through the wire format;
a real grpc.aio server with a stub servicer per service answers every RPC once, including the
bidirectional Router.Generate with a cancel in the middle of the stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from microserving.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)

MODULES = (common_pb2, engine_pb2, router_pb2)


def _all_message_descriptors() -> list[Descriptor]:
    found: list[Descriptor] = []
    for module in MODULES:
        found.extend(module.DESCRIPTOR.message_types_by_name.values())
    return found


def _sample_scalar(field: FieldDescriptor, depth: int) -> object:
    kind = field.type
    if kind == FieldDescriptor.TYPE_STRING:
        return f"{field.name}-{depth}"
    if kind == FieldDescriptor.TYPE_BYTES:
        return f"{field.name}".encode()
    if kind == FieldDescriptor.TYPE_BOOL:
        return True
    if kind in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return 0.5
    if kind == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values[-1].number
    return 7 + depth  # every integer type


def _fill(message: Message, depth: int = 0) -> Message:
    """Set every field (the last member of each oneof wins, so oneofs are set too)."""
    for field in message.DESCRIPTOR.fields:
        is_repeated = field.is_repeated
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_field, value_field = field.message_type.fields
            getattr(message, field.name)[_sample_scalar(key_field, depth)] = _sample_scalar(
                value_field, depth
            )
        elif field.message_type is not None:
            if depth > 3:
                continue
            target = getattr(message, field.name)
            target = target.add() if is_repeated else target
            target.SetInParent()  # set even when it has no fields (an empty oneof event)
            _fill(target, depth + 1)
        elif is_repeated:
            getattr(message, field.name).append(_sample_scalar(field, depth))
        else:
            setattr(message, field.name, _sample_scalar(field, depth))
    return message


def test_contract_defines_every_service_and_rpc() -> None:
    engine = engine_pb2.DESCRIPTOR.services_by_name["Engine"]
    assert [m.name for m in engine.methods] == [
        "PrepRecv", "RemoteSend", "StartGenerate", "Generate", "Abort", "GetStatus",
    ]
    assert engine.methods_by_name["StartGenerate"].server_streaming
    multiplexed = engine.methods_by_name["Generate"]
    assert multiplexed.client_streaming and multiplexed.server_streaming
    push = engine_pb2.DESCRIPTOR.services_by_name["KVTransfer"].methods_by_name["PushKV"]
    assert push.client_streaming and not push.server_streaming
    generate = router_pb2.DESCRIPTOR.services_by_name["Router"].methods_by_name["Generate"]
    assert generate.client_streaming and generate.server_streaming


def test_enum_zero_values_are_unspecified() -> None:
    for module in MODULES:
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            assert enum.values_by_number[0].name.endswith("_UNSPECIFIED"), enum.name


@pytest.mark.parametrize("descriptor", _all_message_descriptors(), ids=lambda d: d.name)
def test_every_message_round_trips_with_every_field_set(descriptor: Descriptor) -> None:
    message = _fill(GetMessageClass(descriptor)())
    wire = message.SerializeToString()
    parsed = GetMessageClass(descriptor).FromString(wire)
    assert parsed == message
    if descriptor.fields:
        assert wire, "a message with every field set serialises to bytes"


def test_windows_may_be_negative_as_in_mlc() -> None:
    request = engine_pb2.RemoteSendRequest(begin=-3, end=-1)
    parsed = engine_pb2.RemoteSendRequest.FromString(request.SerializeToString())
    assert (parsed.begin, parsed.end) == (-3, -1)


class StubEngine(engine_pb2_grpc.EngineServicer):
    """Answers from the request only, so each reply proves the request arrived intact."""

    async def PrepRecv(self, request, context):  # type: ignore[no-untyped-def]
        return engine_pb2.PrepRecvResponse(
            kv_addr_info=request.request_id.encode(), prefix_matched_length=1, end=request.end
        )

    async def RemoteSend(self, request, context):  # type: ignore[no-untyped-def]
        return engine_pb2.RemoteSendResponse(num_tokens_sent=request.end - request.begin)

    async def StartGenerate(self, request, context):  # type: ignore[no-untyped-def]
        for token in request.token_ids[request.begin :]:
            yield engine_pb2.StartGenerateResponse(
                choices=[common_pb2.ChoiceDelta(index=0, token_ids=[token])]
            )
        yield engine_pb2.StartGenerateResponse(
            choices=[common_pb2.ChoiceDelta(finish_reason=common_pb2.FINISH_REASON_STOP)],
            usage=common_pb2.Usage(prompt_tokens=len(request.token_ids)),
        )

    async def Abort(self, request, context):  # type: ignore[no-untyped-def]
        if request.request_id == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad id")
        return engine_pb2.AbortResponse(was_active=True)

    async def GetStatus(self, request, context):  # type: ignore[no-untyped-def]
        return engine_pb2.GetStatusResponse(model_id="stub", roles=[common_pb2.ENGINE_ROLE_BOTH])


class StubKVTransfer(engine_pb2_grpc.KVTransferServicer):
    async def PushKV(self, request_iterator, context):  # type: ignore[no-untyped-def]
        first = await anext(request_iterator)
        if first.WhichOneof("payload") != "header":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "header first")
        written = 0
        async for message in request_iterator:
            written += message.chunk.num_tokens
        return engine_pb2.PushKVResponse(num_tokens_written=written)


class StubRouter(router_pb2_grpc.RouterServicer):
    """Streams one delta per prompt character until the request is cancelled or done."""

    async def Generate(  # type: ignore[override]
        self, request_iterator: AsyncIterator[router_pb2.GenerateRequest], context: object
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        cancelled: set[str] = set()
        async for message in request_iterator:
            if message.WhichOneof("action") == "cancel":
                cancelled.add(message.cancel.request_id)
                yield router_pb2.GenerateResponse(
                    request_id=message.cancel.request_id,
                    finish=router_pb2.ChoiceFinish(reason=common_pb2.FINISH_REASON_ABORT),
                )
                continue
            new = message.generate
            for char in new.text:
                yield router_pb2.GenerateResponse(
                    request_id=new.request_id, delta=common_pb2.ChoiceDelta(text=char)
                )
            if new.request_id not in cancelled and new.text != "forever":
                yield router_pb2.GenerateResponse(
                    request_id=new.request_id,
                    done=router_pb2.RequestDone(usage=common_pb2.Usage(prompt_tokens=len(new.text))),
                )

    async def ListModels(self, request, context):  # type: ignore[no-untyped-def]
        return router_pb2.ListModelsResponse(models=[router_pb2.ModelInfo(id="stub")])

    async def GetStatus(self, request, context):  # type: ignore[no-untyped-def]
        return router_pb2.RouterGetStatusResponse(pattern=router_pb2.PATTERN_DISAGG)

    async def MigrateContext(self, request, context):  # type: ignore[no-untyped-def]
        return router_pb2.MigrateContextResponse(num_tokens_moved=len(request.token_ids.ids))


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(StubEngine(), server)
    engine_pb2_grpc.add_KVTransferServicer_to_server(StubKVTransfer(), server)
    router_pb2_grpc.add_RouterServicer_to_server(StubRouter(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    await server.stop(None)


@pytest.mark.integration
async def test_every_engine_rpc_answers_over_a_real_server(channel: grpc.aio.Channel) -> None:
    stub = engine_pb2_grpc.EngineStub(channel)
    prep = await stub.PrepRecv(engine_pb2.PrepRecvRequest(request_id="r1", end=-1))
    assert (prep.kv_addr_info, prep.end) == (b"r1", -1)
    sent = await stub.RemoteSend(engine_pb2.RemoteSendRequest(request_id="r1", begin=2, end=5))
    assert sent.num_tokens_sent == 3
    stream = stub.StartGenerate(engine_pb2.StartGenerateRequest(token_ids=[5, 6, 7], begin=1))
    messages = [m async for m in stream]
    assert [list(m.choices[0].token_ids) for m in messages[:-1]] == [[6], [7]]
    assert messages[-1].usage.prompt_tokens == 3
    assert (await stub.Abort(engine_pb2.AbortRequest(request_id="r1"))).was_active
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.Abort(engine_pb2.AbortRequest(request_id="bad"))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = await stub.GetStatus(engine_pb2.GetStatusRequest())
    assert list(status.roles) == [common_pb2.ENGINE_ROLE_BOTH]


@pytest.mark.integration
async def test_kv_transfer_push_is_client_streaming(channel: grpc.aio.Channel) -> None:
    stub = engine_pb2_grpc.KVTransferStub(channel)

    async def messages() -> AsyncIterator[engine_pb2.PushKVRequest]:
        yield engine_pb2.PushKVRequest(header=engine_pb2.KVPushHeader(request_id="r1"))
        for begin in (0, 4):
            yield engine_pb2.PushKVRequest(
                chunk=engine_pb2.KVChunkData(begin=begin, num_tokens=4, data=b"\0" * 8)
            )

    response = await stub.PushKV(messages())
    assert response.num_tokens_written == 8


@pytest.mark.integration
async def test_router_generate_is_bidirectional_with_cancel(channel: grpc.aio.Channel) -> None:
    stub = router_pb2_grpc.RouterStub(channel)
    outgoing: asyncio.Queue[router_pb2.GenerateRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[router_pb2.GenerateRequest]:
        while (message := await outgoing.get()) is not None:
            yield message

    call = stub.Generate(requests())
    await outgoing.put(
        router_pb2.GenerateRequest(generate=router_pb2.NewRequest(request_id="a", text="hi"))
    )
    events = [await call.read() for _ in range(3)]
    assert [e.WhichOneof("event") for e in events] == ["delta", "delta", "done"]
    assert "".join(e.delta.text for e in events[:2]) == "hi"
    await outgoing.put(
        router_pb2.GenerateRequest(generate=router_pb2.NewRequest(request_id="b", text="forever"))
    )
    await outgoing.put(router_pb2.GenerateRequest(cancel=router_pb2.CancelRequest(request_id="b")))
    await outgoing.put(None)
    rest = []
    while (event := await call.read()) is not grpc.aio.EOF:
        rest.append(event)
    assert {e.request_id for e in rest} == {"b"}
    assert rest[-1].finish.reason == common_pb2.FINISH_REASON_ABORT
    assert (await call.code()) == grpc.StatusCode.OK
    models = await stub.ListModels(router_pb2.ListModelsRequest())
    assert [m.id for m in models.models] == ["stub"]
    status = await stub.GetStatus(router_pb2.RouterGetStatusRequest())
    assert status.pattern == router_pb2.PATTERN_DISAGG
    migrated = await stub.MigrateContext(
        router_pb2.MigrateContextRequest(token_ids=router_pb2.TokenIds(ids=[1, 2, 3]))
    )
    assert migrated.num_tokens_moved == 3
