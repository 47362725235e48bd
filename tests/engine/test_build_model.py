"""build_model: a model built on the meta device and materialised without torch._refs (whose
first use imports torch._dynamo and sympy, over a second of every shim's start) has exactly
the weights Module.to_empty and the seeded initialisation always gave."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.unit

_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from engine_shim.engine.config import MODEL_PRESETS
    from engine_shim.engine.model import CausalLM, rope_inv_freq
    from engine_shim.engine.weights import build_model, init_random_weights

    config = MODEL_PRESETS["tiny"]
    model = build_model(config, None, seed=0, device="cpu", dtype="float32")
    heavy = sorted(name for name in ("torch._dynamo", "sympy") if name in sys.modules)
    print("imported:", ",".join(heavy) or "-")

    with torch.device("meta"):
        reference = CausalLM(config)
    reference = reference.to_empty(device="cpu")
    reference.model.rotary_emb.inv_freq = rope_inv_freq(config)
    init_random_weights(reference, config, 0)
    if config.tie_word_embeddings:
        reference.lm_head.weight = reference.model.embed_tokens.weight
    reference.fuse(use_fused_kernels=False)
    ours, theirs = model.state_dict(), reference.eval().state_dict()
    assert ours.keys() == theirs.keys(), (ours.keys(), theirs.keys())
    different = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    print("different:", ",".join(different) or "-")
    print("inv_freq equal:", torch.equal(model.model.rotary_emb.inv_freq, rope_inv_freq(config)))
""")


def test_build_model_imports_no_compiler_and_keeps_the_seeded_weights() -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert lines["imported"] == "-", f"building a model imported {lines['imported']}"
    assert lines["different"] == "-", f"weights differ from to_empty's: {lines['different']}"
    assert lines["inv_freq equal"] == "True"
