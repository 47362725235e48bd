"""Fixtures for the embedded engine's tests: tiny engines and tiny Hugging Face checkpoints
written on the spot with `save_pretrained` (nothing is downloaded)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine_shim.backends.embedded.kv_plane.nixl import load_nixl, start_agent
from engine_shim.backends.embedded.kv_plane.nixl_core import NixlSide
from engine_shim.engine.config import EngineConfig
from engine_shim.engine.llm_engine import LLMEngine
from microserving.tokenizer import BYTE_CHAT_TEMPLATE, build_byte_level_backend


@pytest.fixture
def make_engine() -> Callable[..., LLMEngine]:
    def make(**overrides: object) -> LLMEngine:
        base: dict[str, object] = {"num_pages": 256, "page_size": 16}
        base.update(overrides)
        return LLMEngine(EngineConfig(**base))  # type: ignore[arg-type]

    return make


@pytest.fixture
def nixl_pair(make_engine: Callable[..., LLMEngine]) -> Iterator[tuple[LLMEngine, NixlSide, LLMEngine, NixlSide]]:
    """Two engines, each with a real NIXL agent over its pool (UCX over host memory) beside
    it as nixl_core.NixlSide: (prefill, its side, decode, its side). Skipped where NIXL cannot
    load."""
    module, why_not = load_nixl()
    if module is None:
        pytest.skip(why_not)
    engines, sides = [], []
    for _ in range(2):
        engine = make_engine()
        agent, reason = start_agent(engine.kv_cache.kv, loopback=True)
        assert agent is not None, reason
        engines.append(engine)
        sides.append(NixlSide(engine, agent))
    yield engines[0], sides[0], engines[1], sides[1]
    for side in sides:
        side.close()


def _write_tokenizer(path: Path, eos: str = "<|eos|>") -> None:
    build_byte_level_backend().save(str(path / "tokenizer.json"))
    config = {"bos_token": "<|bos|>", "eos_token": {"content": eos}, "chat_template": BYTE_CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def _randomize_biases(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


@pytest.fixture(scope="session")
def hf_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=263, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, initializer_range=0.1, bos_token_id=256, eos_token_id=257,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, max_shard_size="200KB")  # several shards
    _write_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def hf_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen2")
    torch.manual_seed(2)
    config = Qwen2Config(
        vocab_size=263, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, initializer_range=0.1, bos_token_id=256, eos_token_id=257,
    )
    model = Qwen2ForCausalLM(config)
    _randomize_biases(model, 3)
    model.save_pretrained(path)
    _write_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def hf_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mistral with a 16-token sliding window, shorter than the parity prompts, so the window
    mask is exercised in prefill and decode."""
    from transformers import MistralConfig, MistralForCausalLM

    path = tmp_path_factory.mktemp("tiny-mistral")
    torch.manual_seed(4)
    config = MistralConfig(
        vocab_size=263, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        sliding_window=16, tie_word_embeddings=False, initializer_range=0.1,
        bos_token_id=256, eos_token_id=257, attn_implementation="eager",
    )
    model = MistralForCausalLM(config)
    model.save_pretrained(path)
    _write_tokenizer(path)
    return path

