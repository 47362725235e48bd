"""PD disaggregation across two shim processes (embedded tiny engines) over gRPC: the decode
shim reserves (PrepRecv), the prefill shim pushes KV straight to it (RemoteSend), the decode
shim generates (StartGenerate); the tokens equal one shim alone at temperature 0."""

from __future__ import annotations

import pytest
from shim_helpers import PROMPT, generate_alone, pd_flow

pytestmark = pytest.mark.e2e


async def test_pd_with_end_minus_1_matches_single_shim_at_temperature_0(prefill_shim, decode_shim):
    tokens = [t + 100 for t in PROMPT]
    expected = await generate_alone(prefill_shim.address, "alone-end-1", tokens)
    ids, prep, sent = await pd_flow(prefill_shim.address, decode_shim.address, "pd-end-1", tokens, -1)
    assert prep.end == len(tokens) - 1 and prep.prefix_matched_length == 0
    assert sent is not None and sent.num_tokens_sent == len(tokens) - 1 and sent.num_bytes_sent > 0
    assert len(expected) == 16 and ids == expected


async def test_balanced_pd_at_factor_half_matches_single_shim(prefill_shim, decode_shim):
    tokens = [t + 50 for t in PROMPT] + [7, 8, 9]
    end = int((1 - 0.5) * len(tokens))
    expected = await generate_alone(prefill_shim.address, "alone-half", tokens)
    ids, prep, sent = await pd_flow(prefill_shim.address, decode_shim.address, "pd-half", tokens, end)
    assert prep.end == end and sent is not None and sent.num_tokens_sent == end
    assert ids == expected


async def test_prefix_hit_on_decode_skips_remote_send_and_matches(prefill_shim, decode_shim):
    tokens = [t + 150 for t in PROMPT]
    expected = await generate_alone(prefill_shim.address, "alone-prefix", tokens)
    first, _, first_sent = await pd_flow(
        prefill_shim.address, decode_shim.address, "pd-prefix-1", tokens, -1
    )
    end = len(tokens) - 2  # 48 = 3 whole pages, all cached on D by the first request
    second, prep, sent = await pd_flow(
        prefill_shim.address, decode_shim.address, "pd-prefix-2", tokens, end
    )
    assert first_sent is not None and first == expected
    assert prep.prefix_matched_length >= prep.end and sent is None
    assert second == expected
