"""Shared fixtures: a tiny random Llama with the SmolLM2 tokenizer, and the real converted SmolLM2.

`tiny_model_dir` is fast (the GGUF tokenizer is parsed once and kept in pytest's cache folder);
`smollm2_dir` converts the real GGUF (~20 s+) and is meant for tests marked `slow`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

TINY_LAYERS, TINY_HIDDEN = 2, 64


def pytest_configure(config):
    """Run torch single-threaded: the test models are tiny, and on a shared 2-core machine two
    OpenMP threads that wait on each other made small matmuls up to 40x slower than one thread."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _auto_dtype_is_fp32_on_every_cpu(request, monkeypatch):
    """`dtype: auto` computes in fp32 on any CPU inside the test process, so a test's numbers and tolerances
    do not depend on whether this CPU computes bf16 fast (`engine.model.bf16_is_faster`, which asks
    `has_bf16_kernels` first); tests marked
    `cpu_bf16_kernels` see the real answer. Stages run by dvc or papermill (the e2e tests) are other
    processes and take the machine's own answer, as `make repro` does."""
    if request.node.get_closest_marker("cpu_bf16_kernels"):
        return
    from trace_lib.engine import model

    real = model.has_bf16_kernels
    monkeypatch.setattr(model, "has_bf16_kernels", lambda device: False if device.type == "cpu" else real(device))


def _cached_tokenizer(cache_root: Path):
    """The SmolLM2 tokenizer with the trace chat template, parsed from the GGUF only on a cold cache."""
    from transformers import AutoTokenizer

    from trace_lib.engine.chat import tool_chat_template
    from trace_lib.engine.model import load_gguf_tokenizer, smollm2_gguf_path

    gguf = smollm2_gguf_path()
    folder = cache_root / f"tok-{gguf.stat().st_size}"
    if (folder / "tokenizer.json").is_file():
        tok = AutoTokenizer.from_pretrained(folder)
    else:
        tok = load_gguf_tokenizer(gguf)
        tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, folder)
        except OSError:  # another test process filled the cache first
            shutil.rmtree(tmp, ignore_errors=True)
    tok.chat_template = tool_chat_template()
    return tok


def build_tiny_model(out_dir: Path, tokenizer, seed: int = 0) -> Path:
    """A 2-layer random LlamaForCausalLM over `tokenizer`'s vocabulary, saved with the tokenizer.

    The init scale (0.1, not Llama's 0.02) makes greedy outputs differ between prompts, which the
    batching and caching tests need to mean anything.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=TINY_HIDDEN, intermediate_size=2 * TINY_HIDDEN,
        num_hidden_layers=TINY_LAYERS, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=8192, tie_word_embeddings=True, initializer_range=0.1,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"), eos_token_id=im_end, pad_token_id=im_end,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = im_end
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def smollm2_tokenizer(request):
    return _cached_tokenizer(Path(request.config.cache.mkdir("trace_smollm2_tokenizer")))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """Folder of a tiny random Llama (2 layers, hidden 64) + SmolLM2 tokenizer + tool chat template."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), smollm2_tokenizer)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """The real SmolLM2-135M-Instruct converted from the packaged GGUF (use in `slow` tests only)."""
    from trace_lib.engine.model import resolve_model

    return resolve_model("smollm2-135m", tmp_path_factory.mktemp("smollm2") / "model", "float32")
