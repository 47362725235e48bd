"""Pure parts: the shared tokenizer, stop strings, sampling functions, the block manager."""

from __future__ import annotations

import pytest
import torch
from engine_test_utils import random_prompt, tokens_of

from engine_shim.engine.api import FinishReason, SamplingParams
from engine_shim.engine.block_manager import BlockManager, slot_segments
from engine_shim.engine.sampler import top_k_top_p_filter
from microserving.tokenizer import PRESET_NAMES, Tokenizer

pytestmark = pytest.mark.unit


def test_incremental_decoder_never_emits_half_a_utf8_character() -> None:
    tok = Tokenizer.from_model("tiny")
    text = "añb 中文 🙂!"
    ids = tok.encode(text, add_special_tokens=False)
    decoder = tok.incremental_decoder()
    deltas = [decoder.feed([i]) for i in ids] + [decoder.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert len([d for d in deltas if d]) < len(ids)  # multi-byte chars came out whole


def _metaspace_tokenizer() -> Tokenizer:
    """A SentencePiece-style vocabulary ("▁" for a space, which the decoder drops at the start
    of a text), with special tokens: its decoding depends on the tokens around each one."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as HFTokenizer

    pieces = ["<unk>", "▁", "▁a", "b", "▁cd", "é", "e", "▁", "f"]
    backend = HFTokenizer(models.WordLevel({p: i for i, p in enumerate(dict.fromkeys(pieces))}, "<unk>"))
    backend.decoder = decoders.Metaspace()
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    backend.add_tokens([AddedToken("<tool>", special=False)])
    return Tokenizer(backend, bos_token="<s>", eos_tokens=["</s>"], chat_template=None)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("which", ["byte-level", "metaspace"])
def test_incremental_decoder_matches_decode_through_ids_without_text(
    which: str, skip_special_tokens: bool
) -> None:
    """Ids that decode to nothing (past the vocabulary, as a random-weight model samples them,
    or special tokens) stay out of the decoder's window, and the text stays exactly what
    decode() makes of all the ids, whatever the chunks they come in."""
    import random

    tok = Tokenizer.from_model("tiny") if which == "byte-level" else _metaspace_tokenizer()
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.choice([rng.randrange(tok.vocab_size), rng.randrange(tok.vocab_size + 500),
                           rng.randrange(tok.vocab_size - 8, tok.vocab_size)])
               for _ in range(rng.randrange(1, 40))]
        decoder = tok.incremental_decoder(skip_special_tokens=skip_special_tokens)
        text, fed = "", 0
        while fed < len(ids):
            size = rng.randrange(1, 4)
            text += decoder.feed(ids[fed:fed + size])
            fed += size
        assert text + decoder.flush() == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    decoder = tok.incremental_decoder(skip_special_tokens=skip_special_tokens)
    assert [decoder.feed([tok.vocab_size + 1]) for _ in range(1000)] == [""] * 1000
    assert decoder._ids == []  # the run without text never entered the window


def test_byte_tokenizer_specials_and_chat_template() -> None:
    tok = Tokenizer.from_model(PRESET_NAMES[0])
    assert tok.vocab_size == 263 and tok.bos_token_id == 256
    assert tok.encode("hi")[0] == tok.bos_token_id
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|><|user|>hi<|end|><|assistant|>"
    assert ids.count(tok.bos_token_id) == 1
    for bad in ([], [{"content": "x"}], [{"role": "user", "content": 3}], "text"):
        with pytest.raises(ValueError):
            tok.apply_chat_template(bad)  # type: ignore[arg-type]


def test_tokenizer_from_hf_directory(hf_llama_dir) -> None:
    tok = Tokenizer.from_model(str(hf_llama_dir))
    assert tok.eos_token_ids[0] == 257 and tok.bos_token_id == 256
    assert tok.decode(tok.encode("héllo")) == "héllo"
    assert "<|user|>" in tok.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError):
        Tokenizer.from_model("/nonexistent")


def test_stop_string_is_cut_from_text_and_finishes(make_engine) -> None:
    engine = make_engine()
    prompt = random_prompt(1, 20)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("free", prompt, params)
    full = engine.tokenizer.decode(tokens_of(engine.run_until_done()["free"]))
    stop = full[5:7]
    engine.add_request("stopped", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=(stop,)))
    outputs = engine.run_until_done()["stopped"]
    text = "".join(d.text for o in outputs for d in o.deltas)
    assert text == full[: full.index(stop)]
    assert outputs[-1].deltas[-1].finish_reason is FinishReason.STOP


def test_stop_token_ids_logprobs_and_logit_bias(make_engine) -> None:
    engine = make_engine()
    params = SamplingParams(temperature=0, max_tokens=20, logit_bias={65: 100.0}, logprobs=True,
                            top_logprobs=3, ignore_eos=True)
    engine.add_request("biased", [1, 2, 3], params)
    outputs = engine.run_until_done()["biased"]
    assert set(tokens_of(outputs)) == {65}
    lps = [lp for o in outputs for d in o.deltas for lp in d.logprobs]
    assert len(lps) == 20 and all(len(lp.top) == 3 and lp.logprob <= 0 for lp in lps)
    engine.add_request("stop-id", [1, 2, 3], SamplingParams(temperature=0, max_tokens=20, logit_bias={65: 100.0},
                                                            stop_token_ids=(65,)))
    outputs = engine.run_until_done()["stop-id"]
    assert tokens_of(outputs) == [65] and outputs[-1].deltas[-1].finish_reason is FinishReason.STOP


def test_top_k_top_p_filter_keeps_the_right_tokens() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isfinite(top_k_top_p_filter(logits, 2, 1.0)).tolist() == [True, True, False, False]
    assert torch.isfinite(top_k_top_p_filter(logits, 0, 0.8)).tolist() == [True, True, False, False]
    assert torch.isfinite(top_k_top_p_filter(logits, 0, 0.01)).tolist() == [True, False, False, False]


def test_block_manager_prefix_cache_refcounts_and_lru_eviction() -> None:
    bm = BlockManager(num_pages=4, page_size=2, enable_prefix_cache=True)
    tokens = [1, 2, 3, 4, 5]
    pages = bm.allocate(3)
    bm.release(pages, tokens, num_computed_tokens=5)  # two full pages are cached
    assert bm.num_free_pages == 4 and bm.prefix_cache_stats().num_cached_pages == 2
    hit = bm.acquire_prefix([1, 2, 3, 4, 9], max_tokens=4)
    assert hit == pages[:2] and bm.num_free_pages == 2
    assert bm.acquire_prefix([7, 7, 7, 7], max_tokens=4) == []
    bm.release(hit)
    taken = bm.allocate(4)  # needs the two evictable cached pages too
    assert sorted(taken) == [0, 1, 2, 3] and bm.prefix_cache_stats().num_cached_pages == 0
    bm.release(taken)
    assert bm.num_free_pages == 4
    assert slot_segments([4, 5, 6, 12, 13, 2]) == [(4, 3), (12, 2), (2, 1)]
