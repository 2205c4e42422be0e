"""What the scheduler sends to the detokenizer after a step: new tokens, finish reasons, logprobs."""
from __future__ import annotations

from typing import Any

from radixserve.core.io_struct import BatchTokenIDOut
from radixserve.core.req import Req


def needs_send(req: Req, stream_interval: int) -> bool:
    if req.finished:
        return True
    pending = len(req.output_ids) - req.sent_output_len
    return req.stream and pending > 0 and (pending >= stream_interval or req.sent_output_len == 0)


def _take_logprobs(req: Req, meta: dict[str, Any]) -> None:
    if not req.return_logprob:
        return
    if not req.sent_input_logprobs and (req.finished or req.output_ids):
        entries: list[Any] = req.input_token_logprobs
        tops: list[Any] = req.input_top_logprobs if req.top_logprobs_num else []
        if req.logprob_start_len == 0 and len(entries) == len(req.origin_input_ids) - 1:
            # the first prompt token has no logprob: listed with None, as SGLang does, so
            # entry i is prompt token i
            entries = [(None, req.origin_input_ids[0])] + entries
            tops = [None] + tops if tops else tops
        meta["input_token_logprobs"] = entries
        meta["input_top_logprobs"] = tops
        req.sent_input_logprobs = True
    end = len(req.output_token_logprobs)
    meta["output_token_logprobs"] = req.output_token_logprobs[req.sent_logprob_len:end]
    meta["output_top_logprobs"] = (req.output_top_logprobs[req.sent_logprob_len:end]
                                   if req.top_logprobs_num else [])
    req.sent_logprob_len = end


def build_token_output(reqs: list[Req]) -> BatchTokenIDOut | None:
    """Collect everything not yet sent for `reqs` (callers pick them with needs_send)."""
    if not reqs:
        return None
    out = BatchTokenIDOut(rids=[], new_output_ids=[], finished_reasons=[], meta_infos=[],
                          skip_special_tokens=[], spaces_between_special_tokens=[], stop_strs=[])
    for req in reqs:
        out.rids.append(req.rid)
        out.new_output_ids.append(req.output_ids[req.sent_output_len:])
        req.sent_output_len = len(req.output_ids)
        out.finished_reasons.append(req.finished_reason.to_json() if req.finished_reason
                                    else None)
        meta = req.meta_info()
        _take_logprobs(req, meta)
        out.meta_infos.append(meta)
        params = req.sampling_params
        out.skip_special_tokens.append(params.skip_special_tokens)
        out.spaces_between_special_tokens.append(params.spaces_between_special_tokens)
        out.stop_strs.append(params.stop_strs)
        out.keep_special_tokens.append(params.keep_special_tokens)
        out.include_stop.append(params.include_stop_str_in_output)
    return out


class OutputSlice:
    """The decode part of a MIXED pass's output (rows offset.. of the batch)."""

    def __init__(self, out: Any, offset: int) -> None:
        self.next_token_ids = out.next_token_ids[offset:]
        self.next_token_logprobs = None
        self.next_top_logprobs = None
