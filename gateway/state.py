"""What one running gateway holds: settings, the router client and the serving objects."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.admission import AdmissionLimit
from gateway.auth import ApiKeyChecker
from gateway.metrics import GatewayMetrics
from gateway.router_client import RouterClient, RouterLink
from gateway.serving.base import ServingContext
from gateway.serving.chat import ChatServing
from gateway.serving.completion import CompletionServing
from gateway.settings import GatewaySettings
from microserving.transport import TransportSettings


@dataclass
class GatewayState:
    settings: GatewaySettings
    router: RouterLink
    metrics: GatewayMetrics
    api_keys: ApiKeyChecker
    completions: CompletionServing
    chat: ChatServing

    @classmethod
    def create(cls, settings: GatewaySettings, metrics: GatewayMetrics,
               router: RouterLink | None = None) -> GatewayState:
        """Must run inside the event loop that serves the app (the gRPC channel binds to it).
        `router`: the router link to use instead of a `RouterClient` of `settings.router`."""
        token = settings.token.get_secret_value() if settings.token else None
        transport = TransportSettings(tls_cert=settings.tls_cert, tls_key=settings.tls_key,
                                      tls_ca=settings.tls_ca, token=token,
                                      tls_server_name=settings.tls_server_name)
        if router is None:
            router = RouterClient(settings.router, transport, max_calls=settings.router_streams,
                                  requests_per_call=settings.requests_per_router_stream)

        api_keys = ApiKeyChecker(settings.all_api_keys())
        context = ServingContext(router=router, metrics=metrics,
                                 admission=AdmissionLimit(settings.max_inflight,
                                                           settings.max_choices_per_request),
                                 served_model_name=settings.served_model_name,
                                 on_error=metrics.count_error, is_keyed=api_keys.is_enabled)
        return cls(settings=settings, router=router, metrics=metrics, api_keys=api_keys,
                   completions=CompletionServing(context), chat=ChatServing(context))
