"""Embedding models (--is-embedding): a decoder checkpoint whose output is the final hidden
state of each input's last token, L2-normalised (Qwen3-Embedding and e5-mistral pool this
way; SGLang's and vLLM's decoder embedding models default to it). A config asking for
bidirectional attention (`is_causal: false`, as some gte-Qwen2 releases) is refused.

Such checkpoints often lack the LM head and keep the decoder's tensors at the top level
(`layers.0...`, `embed_tokens.weight`, saved from `Qwen3Model` / `MistralModel`): the model is
built without a head and those names load under `model.`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.core.forward_batch import ForwardOutput, ModelWorkerBatch
from radixserve.core.model_config import ModelConfig
from radixserve.models.registry import HEADLESS_ARCHITECTURES

if TYPE_CHECKING:
    from torch import nn

    from radixserve.executor.model_runner import ModelRunner

# a headless checkpoint's top-level decoder names -> the model's parameter names
HEADLESS_PREFIXES = {"layers.": "model.layers.", "embed_tokens.": "model.embed_tokens.",
                     "norm.": "model.norm."}


def configure_for_embedding(config: ModelConfig, is_embedding: bool) -> None:
    """Before the model is built: no LM head for an embedding model; a headless checkpoint
    without --is-embedding is refused with the flag to use."""
    if is_embedding:
        if getattr(config.hf, "is_causal", True) is False:
            raise ValueError("this embedding model's config asks for bidirectional attention "
                             "(is_causal: false); radixserve serves causal decoders only")
        config.tie_word_embeddings = True  # the head is the embedding's: nothing to load
    elif config.architecture in HEADLESS_ARCHITECTURES:
        raise ValueError(f"{config.architecture} is a checkpoint without an LM head (an "
                         "embedding model): serve it with --is-embedding")


def adapt_for_embedding(model: "nn.Module") -> None:
    """After the model is built: its checkpoint may keep the decoder at the top level."""
    if not hasattr(model, "embed"):
        raise ValueError(f"{type(model).__name__} cannot serve as an embedding model "
                         "(--is-embedding takes Llama, Mistral, Qwen2/3 and Gemma decoders)")
    model.checkpoint_prefixes = {**getattr(model, "checkpoint_prefixes", {}),  # type: ignore
                                 **HEADLESS_PREFIXES}


def forward_embedding(runner: "ModelRunner", batch: ModelWorkerBatch) -> ForwardOutput:
    """One EXTEND pass of an embedding model: each request's pooled vector (its last
    position's; a chunk before the prompt's last gives one the scheduler drops)."""
    fb = runner.prepare_forward(batch)
    vectors = runner.model.embed(fb.input_ids, fb.positions, fb)  # type: ignore[operator]
    return ForwardOutput([0] * batch.batch_size, embeddings=vectors.tolist())
