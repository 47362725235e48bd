"""The synthetic engine (benchmark only): its step-time profile, and SyntheticCore's schedule and
output driven on a virtual clock (its sleeps advance the clock), so the step times checked are
exactly the schedule's, however loaded the machine is."""

from __future__ import annotations

import pytest

from bench.capacity.nominal import nominal
from engine_shim.backends.synthetic.core import SyntheticCore
from engine_shim.backends.synthetic.profile import StepProfile
from engine_shim.engine.api import (
    FinishReason,
    GenerateOutput,
    InvalidRequestError,
    SamplingParams,
)
from engine_shim.engine.config import EngineConfig
from engine_shim.engine.disaggregation import FirstTokens, SendReady

PROFILE = StepProfile.parse("1:1.03,32:1.33,128:2.01", 120_000)
PROMPT = [ord(c) for c in "the quick brown fox jumps over the lazy dog " * 5]  # 220 tokens


class VirtualClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.now_s += seconds


def _core(clock: VirtualClock | None = None, **config: object) -> SyntheticCore:
    clock = clock or VirtualClock()
    return SyntheticCore(EngineConfig(**config), PROFILE, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]


def _run(core: SyntheticCore) -> dict[str, list[GenerateOutput]]:
    outputs: dict[str, list[GenerateOutput]] = {}
    for _ in range(100_000):
        if not core.has_work:
            return outputs
        for event in core.step():
            if isinstance(event, GenerateOutput):
                outputs.setdefault(event.request_id, []).append(event)
    raise AssertionError("synthetic engine did not finish")


def _text(outputs: list[GenerateOutput], index: int = 0) -> str:
    return "".join(d.text for o in outputs for d in o.deltas if d.index == index)


def _ids(outputs: list[GenerateOutput], index: int = 0) -> list[int]:
    return [t for o in outputs for d in o.deltas if d.index == index for t in d.token_ids]


def _finish(outputs: list[GenerateOutput], index: int = 0) -> FinishReason | None:
    return next(d.finish_reason for o in outputs for d in o.deltas
                if d.index == index and d.finish_reason is not None)


def test_step_time_is_interpolated_between_measured_batches() -> None:
    assert PROFILE.decode_step_s(1) == pytest.approx(1.03e-3)
    assert PROFILE.decode_step_s(32) == pytest.approx(1.33e-3)
    assert PROFILE.decode_step_s(128) == pytest.approx(2.01e-3)
    assert PROFILE.decode_step_s(80) == pytest.approx((1.33 + 0.68 * 48 / 96) * 1e-3)
    assert PROFILE.decode_step_s(16) == pytest.approx((1.03 + 0.30 * 15 / 31) * 1e-3)
    assert PROFILE.decode_step_s(512) == pytest.approx(2.01e-3)  # flat past the last point
    assert PROFILE.decode_step_s(0) == 0.0
    assert PROFILE.step_s(32, 1200) == pytest.approx(1.33e-3 + 0.01)


@pytest.mark.parametrize("text", ["", "1:1.0,1:2.0", "32:1.3,1:1.0", "1:-1", "x:1", "1=2"])
def test_bad_profiles_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        StepProfile.parse(text)


def test_one_request_takes_one_prefill_step_then_one_decode_step_per_token() -> None:
    clock = VirtualClock()
    core = _core(clock)
    core.start_generate("r", PROMPT, 0, SamplingParams(max_tokens=20, ignore_eos=True))
    outputs = _run(core)["r"]
    assert core.num_steps == 20
    expected_s = PROFILE.step_s(1, len(PROMPT)) + 19 * PROFILE.decode_step_s(1)
    assert clock.now_s == pytest.approx(expected_s)
    assert len(_ids(outputs)) == 20 and len(_text(outputs)) == 20  # one character per token
    assert _finish(outputs) is FinishReason.LENGTH
    assert outputs[-1].usage is not None and outputs[-1].usage.completion_tokens == 20


def test_a_batch_steps_at_its_batch_size_and_matches_the_nominal_rate() -> None:
    clock = VirtualClock()
    core = _core(clock, max_num_seqs=64)
    for i in range(32):
        core.start_generate(f"r{i}", [*PROMPT[:255], 97 + i % 20], 0,
                            SamplingParams(max_tokens=256, ignore_eos=True))
    outputs = _run(core)
    assert all(len(_ids(outputs[f"r{i}"])) == 256 for i in range(32))
    # 32 prompts of 256 in chunks of 512 tokens: 16 prefill steps, then decode to 256 tokens.
    rate = 32 * 256 / clock.now_s
    assert rate == pytest.approx(nominal("round-robin", 32, PROFILE, 256, 256).tok_s, rel=0.05)


def test_max_num_seqs_holds_later_requests_back() -> None:
    core = _core(max_num_seqs=2)
    for i in range(3):
        core.start_generate(f"r{i}", PROMPT[:10], 0, SamplingParams(max_tokens=5, ignore_eos=True))
    first = [e for e in core.step() if isinstance(e, GenerateOutput)]
    assert core.status().num_running_requests == 2 and core.status().num_waiting_requests == 1
    assert sorted(o.request_id for o in first) == ["r0", "r1"]
    rest = _run(core)
    assert len(_ids(rest["r2"])) == 5 and all(len(_ids(rest[f"r{i}"])) == 4 for i in (0, 1))


def test_tokens_depend_on_prompt_and_seed_only() -> None:
    texts = []
    for request_id, seed in (("a", None), ("b", None), ("c", 7)):
        core = _core()
        core.start_generate(request_id, PROMPT, 0, SamplingParams(max_tokens=30, seed=seed))
        texts.append(_text(_run(core)[request_id]))
    assert texts[0] == texts[1] != texts[2]


def test_n_stop_strings_and_logprobs() -> None:
    core = _core()
    core.start_generate("n", PROMPT, 0, SamplingParams(max_tokens=12, n=3, ignore_eos=True))
    core.start_generate("lp", PROMPT, 0, SamplingParams(max_tokens=6, logprobs=True, top_logprobs=3))
    outputs = _run(core)
    assert [len(_ids(outputs["n"], i)) for i in range(3)] == [12, 12, 12]
    assert len({_text(outputs["n"], i) for i in range(3)}) == 3  # each choice its own stream
    logprobs = [lp for o in outputs["lp"] for d in o.deltas for lp in d.logprobs]
    assert len(logprobs) == 6 and all(len(lp.top) == 3 and lp.top[0].token_id == lp.token_id
                                      for lp in logprobs)
    reference = _text(outputs["lp"])
    stop = reference[3:5]  # a stop string that the stream is known to contain
    core.start_generate("stop", PROMPT, 0, SamplingParams(max_tokens=6, stop=(stop,)))
    stopped = _run(core)["stop"]
    assert _finish(stopped) is FinishReason.STOP
    assert _text(stopped) == reference[: reference.index(stop)]


def test_unmodelled_sampling_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="synthetic"):
        _core().start_generate("r", PROMPT, 0, SamplingParams(logit_bias={65: 5.0}))


def test_pages_return_after_finish_and_abort() -> None:
    core = _core(num_pages=100)
    core.start_generate("done", PROMPT, 0, SamplingParams(max_tokens=8))
    core.start_generate("aborted", PROMPT, 0, SamplingParams(max_tokens=8))
    core.step()
    assert core.num_free_pages < 100
    assert core.abort("aborted")
    outputs = _run(core)
    assert _finish(outputs["aborted"]) is FinishReason.ABORT
    assert core.num_free_pages == 100


def test_disaggregated_flow_moves_position_stamped_kv_and_gives_the_same_tokens() -> None:
    sampling = SamplingParams(max_tokens=10, ignore_eos=True)
    alone = _core()
    alone.start_generate("r", PROMPT, 0, sampling)
    reference = _ids(_run(alone)["r"])

    prefill, decode = _core(), _core()
    end = len(PROMPT) - 1
    reservation = decode.prep_recv("r", PROMPT, -1, sampling)
    assert reservation.end == end and reservation.prefix_matched_length == 0
    prefill.remote_send("r", PROMPT, 0, end)
    events: list[object] = []
    while not any(isinstance(e, SendReady) for e in events):
        events += prefill.step()
    for begin, num_tokens in prefill.export_windows("r"):
        decode.import_kv("r", prefill.export_kv("r", begin, num_tokens))
    prefill.finish_remote_send("r")
    assert prefill.num_free_pages == prefill.num_pages
    decode.start_generate("r", PROMPT, end, sampling)
    assert _ids(_run(decode)["r"]) == reference
    assert decode.num_free_pages == decode.num_pages


def test_kv_for_the_wrong_window_is_refused() -> None:
    prefill, decode = _core(), _core()
    decode.prep_recv("r", PROMPT, 100)
    prefill.remote_send("r", PROMPT, 0, 100)
    while not any(isinstance(e, SendReady) for e in prefill.step()):
        pass
    chunk = prefill.export_kv("r", 10, 20)
    with pytest.raises(InvalidRequestError, match="positions"):
        decode.import_kv("r", type(chunk)(begin=30, num_tokens=20, data=chunk.data))


def test_device_clock_chains_decode_steps_and_waits_for_the_host_otherwise() -> None:
    from engine_shim.backends.synthetic.device_clock import DeviceClock

    clock = DeviceClock()
    assert clock.step_ends_at(10.0, 1.0, is_chained=True) == 11.0  # idle: starts when called
    # Chained, the host back before the step ended: back to back on the device.
    assert clock.step_ends_at(10.5, 1.0, is_chained=True) == 12.0
    # Chained, the host back late: it was launched when the previous step() began (10.5).
    assert clock.step_ends_at(14.0, 1.0, is_chained=True) == 13.0
    # Not chained (a prompt to schedule): the device waits for the host's call.
    assert clock.step_ends_at(15.0, 2.0, is_chained=False) == 17.0
    assert clock.step_ends_at(15.5, 1.0, is_chained=False) == 18.0  # ... and for the device
    clock.idle()
    assert clock.step_ends_at(30.0, 1.0, is_chained=True) == 31.0


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=10, ignore_eos=True),
    SamplingParams(max_tokens=6, ignore_eos=True, n=3, seed=5, logprobs=True, top_logprobs=2),
    SamplingParams(max_tokens=1, ignore_eos=True, n=2),
])
def test_first_tokens_drawn_on_the_sender_continue_on_the_receiver(sampling: SamplingParams) -> None:
    """As the real engine's (tests/engine/test_first_token_on_sender.py): the sender draws
    each choice's first token once the whole prompt is "computed", the receiver continues
    from it; every choice's tokens and text are the engine alone's, and the pages come back."""
    alone = _core()
    alone.start_generate("r", PROMPT, 0, sampling)
    reference = _run(alone)["r"]

    prefill, decode = _core(), _core()
    end = len(PROMPT) - 1
    decode.prep_recv("r", PROMPT, -1, sampling)
    prefill.remote_send("r", PROMPT, 0, end, first=sampling)
    events: list[object] = []
    while not any(isinstance(e, FirstTokens) for e in events):
        events += prefill.step()
    first = next(e for e in events if isinstance(e, FirstTokens))
    assert isinstance(first.output, GenerateOutput)
    for begin, num_tokens in prefill.export_windows("r"):
        decode.import_kv("r", prefill.export_kv("r", begin, num_tokens))
    prefill.finish_remote_send("r")
    continuations = [(d.index, d.token_ids, b"") for d in first.output.deltas]
    decode.start_generate("r", PROMPT, end, sampling, continuations=continuations)
    outputs = [first.output, *_run(decode).get("r", [])]
    for index in range(sampling.n):
        assert _ids(outputs, index) == _ids(reference, index)
        assert _text(outputs, index) == _text(reference, index)
    assert outputs[-1].usage is not None and reference[-1].usage is not None
    assert outputs[-1].usage.completion_tokens == reference[-1].usage.completion_tokens
    assert prefill.num_free_pages == prefill.num_pages
    assert decode.num_free_pages == decode.num_pages
