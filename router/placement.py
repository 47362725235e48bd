"""Which engine serves each step of a request: least loaded, or the longest cached prefix when
cache-aware (pure functions in policies.py), the pattern and P/D split a request runs, and the
prefix index those choices learn from. Sees the registry's candidates and the attempt, never
the Router."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from microserving.pattern_names import PATTERN_BY_NAME, PatternName
from microserving.v1 import router_pb2
from router.attempt import Attempt, EngineJob
from router.endpoint import DECODE, PREFILL, Endpoint
from router.errors import InvalidRequestError, NoEngineError
from router.policies import AdaptivePolicy, pick_cache_aware, pick_least_loaded
from router.prefix_index import PrefixIndex
from router.registry import EngineRegistry
from router.settings import RouterSettings

_NAME_OF_PATTERN: dict[int, PatternName] = {value: name for name, value in PATTERN_BY_NAME.items()}


def pattern_name(default: PatternName, hints: router_pb2.PatternHints) -> PatternName:
    """The built-in pattern a request runs: its hint, else the router's default."""
    return _NAME_OF_PATTERN.get(hints.pattern, default)


class Placement:
    def __init__(self, settings: RouterSettings, registry: EngineRegistry) -> None:
        self.settings = settings
        self.registry = registry
        self.default_pattern: PatternName = settings.pattern
        self.pd_balance_factor = settings.pd_balance_factor
        self.cache_aware = settings.cache_aware
        self.prefix_index = PrefixIndex(settings.cache_page_size, settings.cache_max_pages_per_engine)
        self.adaptive_policy = AdaptivePolicy(
            min_remote_tokens=settings.adaptive_min_remote_tokens,
            max_prefill_load_ratio=settings.adaptive_max_prefill_load_ratio,
            max_factor=settings.adaptive_max_factor,
        )
        self._turn = itertools.count()
        registry.add_listener(self._on_health_change)

    def _on_health_change(self, endpoint: Endpoint, previous: int) -> None:
        del previous
        if not endpoint.is_available:
            self.prefix_index.forget(endpoint.address)  # it may come back with an empty cache

    def pattern_of(self, attempt: Attempt) -> PatternName:
        return pattern_name(self.default_pattern, attempt.hints)

    def factor_of(self, attempt: Attempt) -> float:
        """The P/D balance factor of a disagg request: its hint, else the router's."""
        if attempt.hints.HasField("pd_balance_factor"):
            factor = attempt.hints.pd_balance_factor
            if not 0.0 <= factor < 1.0:
                raise InvalidRequestError("pd_balance_factor must lie in [0, 1)", param="hints.pd_balance_factor")
            return factor
        return self.pd_balance_factor

    def is_cache_aware(self, attempt: Attempt) -> bool:
        return attempt.hints.cache_aware if attempt.hints.HasField("cache_aware") else self.cache_aware

    def select(self, role: int, job: EngineJob, attempt: Attempt, avoid: Sequence[str] = ()) -> Endpoint:
        """The engine for `role` (NoEngineError when none is healthy)."""
        chosen = self.try_select(role, job, attempt, avoid)
        if chosen is None:
            name = {PREFILL: "prefill", DECODE: "decode"}.get(role, str(role))
            raise NoEngineError(f"no healthy {name} engine is available")
        return chosen

    def try_select(
        self, role: int, job: EngineJob, attempt: Attempt, avoid: Sequence[str] = ()
    ) -> Endpoint | None:
        """Longest cached prefix of the job's prompt when cache-aware (its page hashes
        computed once a job, EngineJob.page_chain), else least loaded; None when none is up."""
        candidates = self.registry.candidates(role, exclude=attempt.excluded | set(avoid))
        turn = next(self._turn)
        if self.is_cache_aware(attempt) and candidates:
            chain = job.page_chain(self.prefix_index.page_size, attempt.cache_salt)
            matched = self.prefix_index.match_chain([c.address for c in candidates], chain)
            chosen = pick_cache_aware(
                candidates, matched, turn,
                min_match_tokens=self.settings.cache_min_match_tokens,
                max_extra_load=self.settings.cache_max_extra_load,
            )
        else:
            chosen = pick_least_loaded(candidates, turn)
        return chosen if isinstance(chosen, Endpoint) else None

    def migration_source(self, token_ids: Sequence[int], target: str) -> str:
        """The engine a context migration copies from: the longest cached prefix, then the
        least loaded."""
        candidates = self.registry.candidates(PREFILL, exclude=[target])
        if not candidates:
            raise InvalidRequestError("no source engine besides the target", param="source")
        matched = self.prefix_index.match_all([c.address for c in candidates], token_ids)
        return max(candidates, key=lambda c: (matched[c.address], -c.load)).address
