"""Req: one generation request as the scheduler sees it.

Memory fields and who owns them:
  req_pool_idx     the ReqToTokenPool row, allocated at admission, freed when the request is
                   cached (finished or retracted) or aborted.
  prefix_indices   KV slots of the prefix matched in the radix cache (owned by the cache; the
                   request holds a lock on `cache_handle`, an opaque handle the cache gave with the match,
                   so they cannot be evicted).
  fill_ids         the tokens whose KV will exist after the current prefill (chunk).
  kv_len           positions [0, kv_len) of the row hold written KV (set by the scheduler).
"""
from __future__ import annotations

import hashlib
import time
from typing import Any, Protocol

import torch

from radixserve.core.finish_reason import FinishReason
from radixserve.core.multimodal import ImageInput, image_key_tokens
from radixserve.core.sampling_params import SamplingParams

# meta_info's key for the wall-clock time (time.time()) the request's first output token was
# sampled, set on its last output only
FIRST_TOKEN_TIME_KEY = "first_token_time"
# meta_info's key for an embedding model's output vector (--is-embedding), on its last output
EMBEDDING_KEY = "embedding"


class Detokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


# a prefix cache key's shift for KV rotated with LongRoPE's long table: past every token id and
# below LoRA's offsets (multiples of 2**32), so each adapter's keys stay apart too
LONG_ROPE_KEY_OFFSET = 1 << 31


def lora_key_offset(lora_name: str | None) -> int:
    """0 for the base model; for an adapter a multiple of 2**32 (past every token id) from a
    64-bit digest of its name, the same in every process (tensor-parallel ranks agree)."""
    if lora_name is None:
        return 0
    digest = hashlib.blake2b(lora_name.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") + 1) << 32


class Req:
    def __init__(self, rid: str, input_ids: list[int], sampling_params: SamplingParams,
                 input_text: str | None = None, return_logprob: bool = False,
                 logprob_start_len: int = -1, top_logprobs_num: int = 0,
                 stream: bool = False, lora_name: str | None = None,
                 lora_cache_id: str | None = None,
                 mm_inputs: list[ImageInput] | None = None) -> None:
        self.rid = rid
        self.lora_name = lora_name  # its LoRA adapter (--lora-paths), or None: the base model
        # its cached prefixes' key: the adapter's name, or a loaded adapter's own id
        self._key_offset = lora_key_offset(lora_cache_id or lora_name)
        self._shifted_prompt: list[int] = []  # cache_key's memo: the prompt, moved
        # LongRoPE (core/long_rope.py): what this request's rope positions add to pick the
        # rotary tables' long rows (0: the short rows, or a model with one table)
        self.rope_table_shift = 0
        # the prompt's images, in order (core/multimodal.py), kept for a recompute after a
        # retraction
        self.mm_inputs: list[ImageInput] = list(mm_inputs or ())
        # prompt spans [start, end) a prefill chunk may not end inside (images whose tokens see
        # each other both ways: Gemma-3's), set by the scheduler
        self.whole_spans: list[tuple[int, int]] = []
        self.origin_input_text = input_text
        self.origin_input_ids = list(input_ids)
        self.sampling_params = sampling_params
        self.return_logprob = return_logprob
        # -1: only output logprobs; k >= 0: also input logprobs from prompt position k on
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.stream = stream
        self.priority = 0  # --enable-priority-scheduling (its order: scheduler/priority.py)

        self.output_ids: list[int] = []
        self.finished_reason: FinishReason | None = None
        # constrained decoding (scheduler/grammar/): the compilation's Future until the
        # grammar is ready, then the request's matcher, which has accepted every output id
        self.grammar_future: Any | None = None
        self.grammar_asked_at = 0.0  # time.monotonic() when its compilation was asked for
        self.grammar_settled = False  # with TP: rank 0 saw it compiled (GrammarManager.settle)
        self.grammar: Any | None = None

        # memory
        self.req_pool_idx: int | None = None
        self.prefix_indices: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.cache_handle: object | None = None
        self.fill_ids: list[int] = []
        self.kv_len = 0  # positions of the row whose KV has been written
        # hybrid models: (state row, tokens) the prefix cache reserved for this request's
        # states after that many tokens, written by one of its prompt's passes, kept when the
        # request is next cached (mem/hybrid_radix_cache.py)
        self.pending_snapshots: list[tuple[int, int]] = []
        self.extend_input_len = 0
        self.is_being_chunked = False
        # speculative decoding: the n-gram proposer's copy of the request's tokens
        # (scheduler/ngram_draft.py), made at its first draft
        self.draft_tokens: Any | None = None
        # an embedding model's output (--is-embedding): the prompt's pooled vector
        self.embedding: list[float] | None = None

        # statistics
        self.cached_tokens = 0  # prompt tokens served from the radix cache (first admission)
        self.retraction_count = 0
        # the most positions whose KV was computed before a retraction (what computing them
        # again counts as recomputed)
        self.computed_before_retraction = 0
        self.created_time = time.time()
        self.first_token_time: float | None = None

        # logprobs, accumulated over the request's life
        self.input_token_logprobs: list[tuple[float, int]] = []
        self.input_top_logprobs: list[list[tuple[float, int]]] = []
        self.output_token_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []

        # how much has already been sent to the detokenizer
        self.sent_output_len = 0
        self.sent_logprob_len = 0
        self.sent_input_logprobs = False

    # ---- lengths ----
    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def cache_key(self, token_ids: list[int]) -> list[int]:
        """The prefix cache's key for `token_ids`, a prefix of this request's all_ids(): the
        tokens themselves, or with a LoRA adapter each moved past every token id by the
        adapter's offset, so that requests share KV only with requests of the same adapter
        (or none), and keys of KV rotated with LongRoPE's long table moved past those of the
        short one; an image's placeholders are keys of its pixels (two prompts share KV past
        an image only when it is the same image). The prompt's part is made once (prompts
        never change; outputs may, as jump-forward replaces a last token)."""
        offset = self._key_offset + (LONG_ROPE_KEY_OFFSET if self.rope_table_shift else 0)
        if not offset and not self.mm_inputs:
            return token_ids
        if not self._shifted_prompt:
            key = list(self.origin_input_ids)
            for image in self.mm_inputs:
                key[image.offset:image.end] = image_key_tokens(image)
            self._shifted_prompt = [token + offset for token in key]
        prompt_len = len(self._shifted_prompt)
        if len(token_ids) <= prompt_len:
            return self._shifted_prompt[:len(token_ids)]
        return self._shifted_prompt + [token + offset for token in token_ids[prompt_len:]]

    def use_rope_table(self, shift: int) -> None:
        """Move a request with no KV to the rope table whose rows start at `shift`
        (core/long_rope.py); its prefix cache keys move with it."""
        if shift != self.rope_table_shift:
            self.rope_table_shift = shift
            self._shifted_prompt = []

    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def rope_shift(self, start: int) -> int:
        """What the rope position of this request's token at index `start` adds to the index,
        up to the images that reach into it: the `rope_delta` of each image that ends at or
        before it (0 but for M-RoPE models' images), plus its rope table's first row."""
        return self.rope_table_shift + sum(image.rope_delta for image in self.mm_inputs
                                           if image.end <= start)

    def init_next_round_input(self) -> None:
        """Before (re)admission: everything so far must be in the KV cache after prefill."""
        self.fill_ids = self.all_ids()

    def remaining_new_tokens(self) -> int:
        return max(self.sampling_params.max_new_tokens - len(self.output_ids), 0)

    # ---- finishing ----
    def check_finished(self, eos_token_ids: set[int], context_len: int,
                       tokenizer: Detokenizer | None) -> None:
        """Set finished_reason after a token was appended to output_ids."""
        if self.finished:
            return
        params = self.sampling_params
        # a stop met by the last token the length allows is still a stop (its string is cut
        # from the text, finish_reason "stop"), as in OpenAI's API and vLLM
        if self.output_ids and len(self.output_ids) >= params.min_new_tokens:
            last = self.output_ids[-1]
            if (not params.ignore_eos and last in eos_token_ids) or \
                    (params.stop_token_ids and last in params.stop_token_ids):
                self.finished_reason = FinishReason.stop_token(last)
                return
            if params.stop_strs and tokenizer is not None:
                matched = self._match_stop_str(tokenizer)
                if matched is not None:
                    self.finished_reason = FinishReason.stop_str(matched)
                    return
        if len(self.output_ids) >= params.max_new_tokens:
            self.finished_reason = FinishReason.max_length(params.max_new_tokens)
        elif self.seqlen >= context_len:
            self.finished_reason = FinishReason.max_length(len(self.output_ids))

    def _match_stop_str(self, tokenizer: Detokenizer) -> str | None:
        # a stop string of L chars spans at most L tokens; decode a small tail window
        window = self.sampling_params.stop_str_max_len + 1
        tail = tokenizer.decode(self.output_ids[-window:],
                                skip_special_tokens=self.sampling_params.skip_special_tokens)
        for stop in self.sampling_params.stop_strs:
            if stop in tail:
                return stop
        return None

    def meta_info(self) -> dict[str, Any]:
        meta = {
            "prompt_tokens": len(self.origin_input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finished_reason.to_json() if self.finished_reason else None,
        }
        if self.finished_reason is not None and self.first_token_time is not None:
            # for the HTTP process's time-to-first-token of requests it saw no tokens of
            # before their end (not streamed); it takes the key out of what users see
            meta[FIRST_TOKEN_TIME_KEY] = self.first_token_time
        if self.finished_reason is not None and self.embedding is not None:
            meta[EMBEDDING_KEY] = self.embedding
        return meta

    def __repr__(self) -> str:
        return (f"Req(rid={self.rid!r}, input_len={len(self.origin_input_ids)}, "
                f"output_len={len(self.output_ids)}, finished={self.finished_reason})")
