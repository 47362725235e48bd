"""The one small interface every engine backend implements (embedded torch engine, MLC-LLM),
and the shim-level results it returns. The servicer validates before calling any of these."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from grpc import aio

from engine_shim.engine.api import (
    Continuation,
    EngineStatus,
    GenerateOutput,
    KVLayout,
    OnFirst,
    SamplingParams,
)
from engine_shim.engine.validation import TokenIds

# Told when a KV push into a reservation begins (True) and ends (False): the shim's request
# tracker holds its view of the reservation alike.
HoldListener = Callable[[str, bool], None]


@dataclass(frozen=True)
class BackendInfo:
    """What the shim needs to know about its engine to validate calls up front."""

    name: str  # "embedded" | "mlc"
    model_id: str
    device: str
    vocab_size: int
    max_context_length: int
    kv_layout: KVLayout | None  # None when the backend does not expose it (MLC)
    # generate's after_kv is served: a start may wait for its reservation's KV transfer
    starts_after_kv: bool = False
    # remote_send_later is served: a send may start before its receiver is known
    takes_kv_addr_later: bool = False
    # sampling_first and generate's continuations are served
    samples_first_token: bool = False


class FirstDelivery(Protocol):
    async def delivered(self) -> None:
        """After the send's result: its first tokens went to `on_first` before it, or this
        raises (the send sampled nothing)."""
        ...


@dataclass(frozen=True)
class Reservation:
    """Result of prep_recv: the slots reserved on this engine, described for the sender."""

    request_id: str
    end: int  # normalised window end
    prefix_matched_length: int
    kv_addr_info: bytes  # opaque to the router


@dataclass(frozen=True)
class SendTarget:
    """The receiver of a send made before it was known (RemoteSendTarget), checked: `begin`
    is within the send's window."""

    kv_addr_info: bytes
    begin: int
    recv_rank: int


@dataclass(frozen=True)
class SendResult:
    num_tokens_sent: int
    num_bytes_sent: int
    num_cached_tokens: int


class KVTransferService(Protocol):
    """A backend's shim-to-shim KV data plane (`microserving.v1.KVTransfer`), served on the
    shim's gRPC server beside the Engine service."""

    def add_to_server(self, server: aio.Server) -> None: ...

    def drain(self) -> None:
        """The shim drains for shutdown: long-lived streams end once nothing is open on
        them (new calls are refused by the server)."""
        ...


class Backend(Protocol):
    """An engine behind the shim. Windows reaching it are normalised and valid."""

    @property
    def info(self) -> BackendInfo: ...

    async def start(self, advertise_address: str) -> None:
        """Load and warm up; `advertise_address` is where peers reach this shim."""

    async def shutdown(self) -> None: ...

    async def prep_recv(
        self, request_id: str, token_ids: TokenIds, end: int, sampling: SamplingParams,
        whole_prompt: bool = False,
    ) -> Reservation: ...

    async def remote_send(
        self,
        request_id: str,
        token_ids: TokenIds,
        begin: int,
        end: int,
        kv_addr_info: bytes,
        recv_rank: int,
        sampling: SamplingParams,
    ) -> SendResult: ...

    async def remote_send_later(
        self,
        request_id: str,
        token_ids: TokenIds,
        begin: int,
        end: int,
        sampling: SamplingParams,
        target: Awaitable[SendTarget],
    ) -> SendResult:
        """remote_send whose receiver comes later (RemoteSendRequest.kv_addr_follows): the KV
        of prompt[:end] is computed from now on, and [target.begin, end) goes to the target
        once `target` resolves (it raises: the send fails with that error). Only where
        `info.takes_kv_addr_later`."""
        ...

    def sampling_first(
        self, request_id: str, sampling: SamplingParams, on_first: OnFirst
    ) -> AbstractContextManager[FirstDelivery]:
        """Around a remote_send / remote_send_later of `request_id`: the send also samples the
        request's first tokens with `sampling` and hands them to `on_first` as they come
        (RemoteSendRequest.sample_first_token). Only where `info.samples_first_token`."""
        ...

    def generate(
        self, request_id: str, token_ids: TokenIds, begin: int, sampling: SamplingParams,
        after_kv: bool = False, continuations: Sequence[Continuation] = (),
    ) -> AsyncIterator[GenerateOutput]:
        """Stream outputs; closing the iterator early aborts the request. `after_kv`
        (StartGenerateRequest.after_kv_transfer, only where `info.starts_after_kv`): the
        request starts once the KV transfer into its PrepRecv reservation has completed, and
        fails FAILED_PRECONDITION if the reservation ends without it. `continuations`
        (StartGenerateRequest.continuations, only where `info.samples_first_token`): the
        choices go on from the first tokens the sender sampled."""
        ...

    async def run_generate(
        self, request_id: str, token_ids: TokenIds, begin: int, sampling: SamplingParams,
        on_output: Callable[[GenerateOutput], None], after_kv: bool = False,
        continuations: Sequence[Continuation] = (),
    ) -> None:
        """`generate` with each output handed to `on_output` as it comes (the multiplexed
        Engine.Generate path); returns once the request finished, raises when it failed.
        Cancelling it aborts the request."""
        ...

    async def abort(self, request_id: str) -> bool: ...

    async def status(self) -> EngineStatus: ...

    def num_receive_tickets(self) -> int | None:
        """Receive tickets open on this shim's KV plane (PrepRecv reservations a push or
        write may fill, or filled and not yet taken by their start); None where KV reaches
        the engine another way. Read by the metrics thread: a length, no lock needed."""
        ...

    def kv_sends(self) -> Mapping[str, int] | None:
        """RemoteSends this shim completed, by the path their KV took (`nixl`, `shm-stream`,
        `shm`, `grpc`); None where KV moves another way. Read by the metrics thread."""
        ...

    def kv_transfer_servicer(self, on_hold: HoldListener | None = None) -> KVTransferService | None:
        """The KV data plane this backend receives on, or None when KV reaches its engine
        another way (MLC's engines move it themselves)."""
        ...

    def tell_peers(self, addresses: Sequence[str]) -> None:
        """The engines a router has registered (GetStatusRequest.kv_peers): where KV may go."""

    async def wait_lost(self) -> str:
        """Returns (why) once the engine is gone for good and the shim cannot serve again
        (an engine core process that died); never returns for a backend that cannot tell."""
        ...

