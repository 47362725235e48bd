"""The hostile-input corpus: malformed and hostile requests for the gateway (HTTP), the
router and the shim (gRPC), each with the answers it may get. Built in code so every case is
readable; counted by the test (at least 150 in all)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from grpc import StatusCode

from microserving.v1 import common_pb2, engine_pb2, router_pb2

PROMPT_IDS = list(range(10, 60))  # 50 byte tokens
MAX_CONTEXT = 2048
VOCAB = 259  # the tiny model's byte vocabulary plus specials; anything >= is out of range


@dataclass(frozen=True)
class HttpCase:
    name: str
    path: str
    content: bytes
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "application/json"})
    # False: not a valid HTTP message (e.g. control characters in a header value, RFC 9110
    # 5.5): uvicorn's HTTP parser answers 400 itself and the request never reaches the app,
    # so there is no OpenAI error body to expect.
    is_valid_http: bool = True


def _json(value: object) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def _nested(depth: int) -> bytes:
    return b'{"prompt": "x", "user": ' + b"[" * depth + b"]" * depth + b"}"


def _completion_cases() -> Iterator[tuple[str, object]]:
    good = {"prompt": "hi", "max_tokens": 2}
    bad_fields: dict[str, list[object]] = {
        "prompt": [5, True, {}, [[]], [1.5], [-1], [VOCAB + 10], [2**40], ["a", 1], [], "", [[1, 2], 3],
                   "a" * 200_000, list(range(10, 60)) * 60, [[10] * 3000]],
        "max_tokens": [-1, 0, "ten", 10**9, 2**64, 2**31, 3.5, [], {}],
        "temperature": [-1, 3, "hot", [], math.inf],
        "top_p": [0, -0.5, 1.5, "x"],
        "top_k": [-1, "k", 1.5, 2**40],
        "n": [0, 17, 10**6, -3, "two"],
        "logprobs": [-1, 100, "yes"],
        "logit_bias": [{"abc": 1}, {"1": 1000}, {"-5": 1}, {str(10**6): 1}, {str(2**40): 1}, [1, 2], "x",
                       {str(i): 1 for i in range(5000)}],
        "stop": [["s"] * 5000, ["x" * 100_000], 5, [1, 2], [[]]],
        "stream": ["maybe", 2, []],
        "stream_options": [5, "x", {"include_usage": "maybe"}],
        "seed": ["s", 2**70, -(2**64), 1.5],
        "frequency_penalty": [5, -5, "x"],
        "presence_penalty": [5, -5],
        "stop_token_ids": [[-1], [10**9], "x", [1.5]],
        "microserving": [{"pattern": "teleport"}, {"pd_balance_factor": 1.5}, {"pd_balance_factor": -0.1}, 5],
        "echo": ["loud"],
        "best_of": [0, 5],
        "suffix": [5],
        "model": ["no-such-model", 7],
        "user": [{"a": 1}],
    }
    for field_name, values in bad_fields.items():
        for i, value in enumerate(values):
            yield f"completion {field_name} #{i}", {**good, field_name: value}
    yield "completion missing prompt", {"max_tokens": 2}
    yield "completion prompt too long for max_tokens", {"prompt": [10] * 2000, "max_tokens": 2000}


def _chat_cases() -> Iterator[tuple[str, object]]:
    yield "chat no messages", {"max_tokens": 2}
    yield "chat empty messages", {"messages": []}
    yield "chat messages not a list", {"messages": "hello"}
    yield "chat bad role", {"messages": [{"role": "hacker", "content": "x"}]}
    yield "chat content number", {"messages": [{"role": "user", "content": 5}]}
    yield "chat content bad part", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    yield "chat content part no text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}
    yield "chat missing role", {"messages": [{"content": "x"}]}
    yield "chat huge message", {"messages": [{"role": "user", "content": "z" * 300_000}]}
    yield "chat many messages", {"messages": [{"role": "user", "content": "m"}] * 5000}
    yield "chat n too big", {"messages": [{"role": "user", "content": "x"}], "n": 99}
    yield "chat temperature NaN", {"messages": [{"role": "user", "content": "x"}], "temperature": math.nan}
    yield "chat max_tokens negative", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}
    yield "chat top_logprobs too big", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                       "top_logprobs": 1000}
    yield "chat unknown model", {"messages": [{"role": "user", "content": "x"}], "model": "gpt-99"}
    yield "chat stop thousands", {"messages": [{"role": "user", "content": "x"}], "stop": ["q"] * 3000}


def http_cases() -> list[HttpCase]:
    cases = [HttpCase(name, "/v1/completions", _json(body)) for name, body in _completion_cases()]
    cases += [HttpCase(name, "/v1/chat/completions", _json(body)) for name, body in _chat_cases()]
    raw: dict[str, bytes] = {
        "empty body": b"", "open brace": b"{", "open bracket": b"[", "null": b"null", "number": b"42",
        "string": b'"prompt"', "list": b"[1, 2, 3]", "truncated": b'{"prompt": "x", "max_tokens":',
        "trailing comma": b'{"prompt": "x",}', "nul byte": b"\x00", "invalid utf-8 body": b"\xff\xfe\xfd",
        "invalid utf-8 in string": b'{"prompt": "\xff\xc3(", "max_tokens": 2}',
        "lone surrogate": b'{"prompt": "\\ud800", "max_tokens": 2}',
        "NaN literal": b'{"prompt": "x", "temperature": NaN}',
        "Infinity literal": b'{"prompt": "x", "max_tokens": Infinity}',
        "-Infinity literal": b'{"prompt": "x", "top_p": -Infinity}',
        "1e400": b'{"prompt": "x", "temperature": 1e400}',
        "huge integer": b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        "deep nesting 100": _nested(100), "deep nesting 10000": _nested(10_000),
        "deep nesting 100000": _nested(100_000),
        "deep object nesting": b'{"prompt": "x", "logit_bias": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}",
        "duplicate keys": b'{"prompt": "x", "prompt": 5}',
        "8 MB prompt": _json({"prompt": "y" * (8 * 1024 * 1024)}),
    }
    cases += [HttpCase(name, "/v1/completions", body) for name, body in raw.items()]
    cases += [
        HttpCase("text/plain body", "/v1/completions", b"prompt=hi", headers={"content-type": "text/plain"}),
        HttpCase("form body", "/v1/completions", b"prompt=hi",
                 headers={"content-type": "application/x-www-form-urlencoded"}),
        HttpCase("GET completions", "/v1/completions", b"", method="GET"),
        HttpCase("DELETE models", "/v1/models", b"", method="DELETE"),
        HttpCase("unknown path", "/v1/nothing-here", b"{}"),
        HttpCase("path traversal", "/v1/../../etc/passwd", b"", method="GET"),
        HttpCase("garbage auth header", "/v1/completions", b"{", headers={
            "content-type": "application/json", "authorization": "Bearer \x01\x02"},
            is_valid_http=False),
    ]
    return cases


# ---- gRPC: the router ----

@dataclass(frozen=True)
class RouterCase:
    """Messages for one Generate stream; `codes` the acceptable RequestError / status codes."""

    name: str
    messages: list[router_pb2.GenerateRequest]
    codes: frozenset[StatusCode]


_INVALID = frozenset({StatusCode.INVALID_ARGUMENT})
_TOO_BIG = frozenset({StatusCode.INVALID_ARGUMENT, StatusCode.OUT_OF_RANGE, StatusCode.RESOURCE_EXHAUSTED})


def _new(request_id: str = "h", **fields: object) -> router_pb2.GenerateRequest:
    if not {"text", "token_ids", "chat"} & set(fields):
        fields["text"] = "hostile"
    if "sampling" not in fields:
        fields["sampling"] = common_pb2.SamplingParams(max_tokens=2)
    return router_pb2.GenerateRequest(generate=router_pb2.NewRequest(request_id=request_id, **fields))  # type: ignore[arg-type]


def _sampling(**fields: object) -> common_pb2.SamplingParams:
    fields.setdefault("max_tokens", 2)
    return common_pb2.SamplingParams(**fields)  # type: ignore[arg-type]


def router_cases() -> list[RouterCase]:
    ids = router_pb2.TokenIds
    bad_sampling = {
        "temperature NaN": _sampling(temperature=math.nan), "temperature -1": _sampling(temperature=-1),
        "temperature inf": _sampling(temperature=math.inf), "top_p 2": _sampling(top_p=2),
        "top_p 0": _sampling(top_p=0), "top_k -1": _sampling(top_k=-1), "n 0": _sampling(n=0),
        "n 1000": _sampling(n=1000), "max_tokens -1": _sampling(max_tokens=-1),
        "stop 5000": _sampling(stop=["s"] * 5000),
        "stop 100k chars": _sampling(stop=["x" * 100_000]), "stop_token_ids oov": _sampling(stop_token_ids=[10**8]),
        "top_logprobs 1000": _sampling(logprobs=True, top_logprobs=1000),
        "frequency_penalty 9": _sampling(frequency_penalty=9), "presence_penalty NaN": _sampling(presence_penalty=math.nan),
        "logit_bias oov": _sampling(logit_bias={10**7: 1.0}), "logit_bias huge": _sampling(logit_bias={5: 1e30}),
    }
    cases = [RouterCase(f"router sampling {name}", [_new(sampling=s)], _INVALID) for name, s in bad_sampling.items()]
    cases += [
        # Prompt + max_tokens past the context: OUT_OF_RANGE (the gateway's 400
        # context_length_exceeded, as OpenAI answers it).
        RouterCase("router sampling max_tokens 2^31-1", [_new(sampling=_sampling(max_tokens=2**31 - 1))],
                   _TOO_BIG),
        RouterCase("router no input", [_new(text="")], _INVALID),
        RouterCase("router empty token ids", [_new(token_ids=ids(ids=[]))], _INVALID),
        RouterCase("router negative token id", [_new(token_ids=ids(ids=[-5, 10]))], _INVALID),
        RouterCase("router oov token id", [_new(token_ids=ids(ids=[10, VOCAB + 1000]))], _INVALID),
        RouterCase("router prompt over context", [_new(token_ids=ids(ids=[10] * (MAX_CONTEXT + 10)))], _TOO_BIG),
        RouterCase("router enormous text", [_new(text="w" * 1_000_000)], _TOO_BIG),
        RouterCase("router unknown model", [_new(model="nope")], frozenset({StatusCode.NOT_FOUND})),
        RouterCase("router empty request id", [_new(request_id="")], _INVALID),
        RouterCase("router 300-char request id", [_new(request_id="i" * 300)], _INVALID),
        RouterCase("router duplicate request id", [_new("dup", sampling=_sampling(max_tokens=50)),
                                                   _new("dup")], _INVALID),
        RouterCase("router neither generate nor cancel", [router_pb2.GenerateRequest()], _INVALID),
        RouterCase("router balance factor 1.5", [_new(hints=router_pb2.PatternHints(pd_balance_factor=1.5))], _INVALID),
        RouterCase("router balance factor NaN", [_new(hints=router_pb2.PatternHints(pd_balance_factor=math.nan))], _INVALID),
        RouterCase("router chat no messages", [_new(chat=router_pb2.ChatMessages())], _INVALID),
        RouterCase("router oversized message", [_new(text="o" * (70 * 1024 * 1024))],
                   frozenset({StatusCode.RESOURCE_EXHAUSTED})),
    ]
    return cases


def cancel_unknown() -> list[router_pb2.GenerateRequest]:
    """A cancel for an id that never started, then a good request on the same stream."""
    return [router_pb2.GenerateRequest(cancel=router_pb2.CancelRequest(request_id="ghost")),
            _new("after-ghost")]


# ---- gRPC: the shim ----

@dataclass(frozen=True)
class ShimCase:
    name: str
    method: str  # PrepRecv | RemoteSend | StartGenerate | Abort
    request: object
    codes: frozenset[StatusCode]


def _greedy(**fields: object) -> common_pb2.SamplingParams:
    fields.setdefault("max_tokens", 2)
    fields.setdefault("temperature", 0.0)
    return common_pb2.SamplingParams(**fields)  # type: ignore[arg-type]


def shim_cases() -> list[ShimCase]:
    prep, send, start = engine_pb2.PrepRecvRequest, engine_pb2.RemoteSendRequest, engine_pb2.StartGenerateRequest
    inv = _INVALID
    n = len(PROMPT_IDS)
    cases = [
        ShimCase("prep_recv end = len", "PrepRecv", prep(request_id="w1", token_ids=PROMPT_IDS, end=n, sampling=_greedy()), inv),
        ShimCase("prep_recv end past len", "PrepRecv", prep(request_id="w2", token_ids=PROMPT_IDS, end=10**6, sampling=_greedy()), inv),
        ShimCase("prep_recv end very negative", "PrepRecv", prep(request_id="w3", token_ids=PROMPT_IDS, end=-10**6, sampling=_greedy()), inv),
        ShimCase("prep_recv empty prompt", "PrepRecv", prep(request_id="w4", token_ids=[], end=0, sampling=_greedy()), inv),
        ShimCase("prep_recv oov", "PrepRecv", prep(request_id="w5", token_ids=[10, 10**6], end=1, sampling=_greedy()), inv),
        ShimCase("prep_recv negative id", "PrepRecv", prep(request_id="w6", token_ids=[-1, 10], end=1, sampling=_greedy()), inv),
        ShimCase("prep_recv empty request id", "PrepRecv", prep(request_id="", token_ids=PROMPT_IDS, end=-1, sampling=_greedy()), inv),
        ShimCase("prep_recv non-ascii id", "PrepRecv", prep(request_id="é\n", token_ids=PROMPT_IDS, end=-1, sampling=_greedy()), inv),
        ShimCase("prep_recv prompt over context", "PrepRecv", prep(request_id="w7", token_ids=[10] * (MAX_CONTEXT + 1), end=-1, sampling=_greedy()), inv),
        ShimCase("remote_send begin = end", "RemoteSend", send(request_id="s1", token_ids=PROMPT_IDS, begin=5, end=5, kv_addr_info=b"x"), inv),
        ShimCase("remote_send begin > end", "RemoteSend", send(request_id="s2", token_ids=PROMPT_IDS, begin=9, end=3, kv_addr_info=b"x"), inv),
        ShimCase("remote_send end = len", "RemoteSend", send(request_id="s3", token_ids=PROMPT_IDS, begin=0, end=n, kv_addr_info=b"x"), inv),
        ShimCase("remote_send garbage kv_addr_info", "RemoteSend", send(request_id="s4", token_ids=PROMPT_IDS, begin=0, end=-1, kv_addr_info=b"\x00\xffgarbage"), inv),
        ShimCase("remote_send empty kv_addr_info", "RemoteSend", send(request_id="s5", token_ids=PROMPT_IDS, begin=0, end=-1, kv_addr_info=b""), inv),
        ShimCase("remote_send 2 MB kv_addr_info", "RemoteSend", send(request_id="s6", token_ids=PROMPT_IDS, begin=0, end=-1, kv_addr_info=b"a" * (2 * 1024 * 1024)), inv),
        ShimCase("remote_send json kv_addr_info", "RemoteSend", send(request_id="s7", token_ids=PROMPT_IDS, begin=0, end=-1, kv_addr_info=b'{"address": "10.0.0.1:1", "request_id": "s7"}'), inv),
        ShimCase("remote_send oov", "RemoteSend", send(request_id="s8", token_ids=[10**7, 10], begin=0, end=1, kv_addr_info=b"x"), inv),
        ShimCase("start_generate begin = len", "StartGenerate", start(request_id="g1", token_ids=PROMPT_IDS, begin=n, sampling=_greedy()), inv),
        ShimCase("start_generate begin past len", "StartGenerate", start(request_id="g2", token_ids=PROMPT_IDS, begin=10**6, sampling=_greedy()), inv),
        ShimCase("start_generate begin without prep_recv", "StartGenerate", start(request_id="g3", token_ids=PROMPT_IDS, begin=10, sampling=_greedy()),
                 frozenset({StatusCode.FAILED_PRECONDITION, StatusCode.INVALID_ARGUMENT})),
        ShimCase("start_generate empty prompt", "StartGenerate", start(request_id="g4", token_ids=[], sampling=_greedy()), inv),
        ShimCase("start_generate NaN temperature", "StartGenerate", start(request_id="g5", token_ids=PROMPT_IDS, sampling=_greedy(temperature=math.nan)), inv),
        ShimCase("start_generate n 1000", "StartGenerate", start(request_id="g6", token_ids=PROMPT_IDS, sampling=_greedy(n=1000)), inv),
        ShimCase("start_generate stop 5000", "StartGenerate", start(request_id="g7", token_ids=PROMPT_IDS, sampling=_greedy(stop=["s"] * 5000)), inv),
        ShimCase("start_generate max_tokens over context", "StartGenerate", start(request_id="g8", token_ids=PROMPT_IDS, sampling=_greedy(max_tokens=10**6)), inv),
        ShimCase("start_generate negative max_tokens", "StartGenerate", start(request_id="g9", token_ids=PROMPT_IDS, sampling=_greedy(max_tokens=-4)), inv),
        ShimCase("start_generate logit_bias 5000", "StartGenerate", start(request_id="g10", token_ids=PROMPT_IDS, sampling=_greedy(logit_bias={i % 250: 1.0 for i in range(5000)} | {10**5: 1.0})), inv),
        ShimCase("start_generate top_logprobs 99", "StartGenerate", start(request_id="g11", token_ids=PROMPT_IDS, sampling=_greedy(logprobs=True, top_logprobs=99)), inv),
        ShimCase("start_generate 1e6 tokens", "StartGenerate", start(request_id="g12", token_ids=[10] * 1_000_000, sampling=_greedy()), inv),
        ShimCase("abort empty id", "Abort", engine_pb2.AbortRequest(request_id=""), inv),
        ShimCase("abort 1000-char id", "Abort", engine_pb2.AbortRequest(request_id="a" * 1000), inv),
    ]
    return cases
