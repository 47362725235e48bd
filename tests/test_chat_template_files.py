"""Chat templates are found where transformers writes them: chat_template.jinja (what the
installed transformers' save_pretrained writes), chat_template.json, tokenizer_config.json;
and they render as transformers renders them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from microserving.tokenizer import Tokenizer, build_byte_level_backend

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, PreTrainedTokenizerFast]:
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build_byte_level_backend(),
                                        bos_token="<|bos|>", eos_token="<|eos|>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    return tmp_path, tokenizer


def test_a_directory_saved_by_transformers_has_its_chat_template(saved) -> None:
    path, hf = saved
    config = json.loads((path / "tokenizer_config.json").read_text())
    if "chat_template" not in config:  # what transformers 5.x does
        assert (path / "chat_template.jinja").read_text() == TEMPLATE
    ours = Tokenizer.from_model(str(path))
    assert ours.has_chat_template
    assert ours.apply_chat_template(MESSAGES) == hf.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)


def test_chat_template_json_and_tokenizer_config_are_read_too(saved) -> None:
    path, _ = saved
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    assert not Tokenizer.from_model(str(path)).has_chat_template
    (path / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert Tokenizer.from_model(str(path)).apply_chat_template(MESSAGES).endswith("[user]Hi[assistant]")
    (path / "chat_template.json").unlink()
    config_file.write_text(json.dumps({**config, "chat_template": [{"name": "default", "template": TEMPLATE}]}))
    assert Tokenizer.from_model(str(path)).apply_chat_template(MESSAGES).startswith("[system]")
    (path / "chat_template.jinja").write_text("{{ 'jinja wins' }}")  # transformers' precedence
    assert Tokenizer.from_model(str(path)).apply_chat_template(MESSAGES) == "jinja wins"
