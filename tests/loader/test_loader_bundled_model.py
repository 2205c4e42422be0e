"""End to end: the bundled GGUF's weights and tokenizer, run by transformers' own Llama, answer a
simple question correctly, and un-permuting q/k is what makes the model fit text better."""
from __future__ import annotations

import torch

from radixserve.loader.gguf_file import read_gguf
from radixserve.loader.gguf_loader import dequantize_tensor, hf_tensor_name
from radixserve.loader.model_source import load_model_source
from radixserve.loader.tokenizer import get_tokenizer


def test_transformers_llama_runs_the_bundled_weights(bundled_gguf: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    source = load_model_source(None, "auto")
    tokenizer = get_tokenizer(source.tokenizer_source)
    config = LlamaConfig(**source.hf_config)
    with torch.device("meta"):  # skip random init of 135M parameters; weights come next
        model = LlamaForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(dict(source.weights()), strict=False, assign=True)
    assert missing == ["lm_head.weight"] and unexpected == []  # tied to the embedding
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # buffers off meta
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    input_ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=12, do_sample=False,
                                eos_token_id=source.model_config.eos_token_ids)
    answer = tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer

    text = "The capital of France is Paris. It is known for the Eiffel Tower and its museums."
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        nll_ours = model(ids, labels=ids).loss.item()
        gguf_file = read_gguf(bundled_gguf)
        raw_layout = {hf_tensor_name(name): dequantize_tensor(gguf_file, info)
                      for name, info in gguf_file.tensors.items() if "attn_q" in name
                      or "attn_k" in name}
        model.load_state_dict(raw_layout, strict=False)
        nll_raw = model(ids, labels=ids).loss.item()
    assert nll_ours < 3.0 and nll_ours < nll_raw - 0.1
