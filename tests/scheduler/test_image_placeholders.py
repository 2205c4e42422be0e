"""Image placeholders as the scheduler and the front ends handle them (core/multimodal.py,
scheduler/admission.py): markers expanded on ids (LLaVA's image token, Gemma-3's own marker
with its end token), runs already expanded kept, counts checked; per-token attention limits of
images seen both ways; chunks that never end inside such an image."""
from __future__ import annotations

import pytest
import torch

from radixserve.core.multimodal import (ImageInput, VisionSpec, check_images,
                                        expand_image_placeholders, image_attention_limits)
from radixserve.core.req import Req
from radixserve.core.sampling_params import InvalidRequestError, SamplingParams
from radixserve.scheduler.admission import whole_span_take

LLAVA = VisionSpec(9, 3, "<image>")
GEMMA = VisionSpec(9, 3, "<start_of_image>", marker_token_id=7, image_text="...",
                   end_token_id=8, bidirectional=True)


def image(offset: int, size: int = 3) -> ImageInput:
    return ImageInput(torch.zeros(1), offset, size, offset)


def test_markers_expand_and_expanded_runs_stay() -> None:
    ids, offsets = expand_image_placeholders([1, 9, 2, 9, 9, 9, 4, 9, 9], LLAVA, 4)
    assert ids == [1, 9, 9, 9, 2, 9, 9, 9, 4, 9, 9, 9, 9, 9, 9] and offsets == [1, 5, 9, 12]
    ids, offsets = expand_image_placeholders([1, 7, 2, 7, 9, 9, 9, 8, 5], GEMMA, 2)
    assert ids == [1, 7, 9, 9, 9, 8, 2, 7, 9, 9, 9, 8, 5] and offsets == [2, 8]
    check_images(ids, [image(2), image(8)], GEMMA)
    with pytest.raises(InvalidRequestError, match=r"2 image placeholder\(s\).*for 1 image"):
        expand_image_placeholders([7, 1, 7], GEMMA, 1)
    stray, offsets = expand_image_placeholders([1, 9, 9, 2], GEMMA, 0)  # not a whole image
    assert offsets == []
    with pytest.raises(InvalidRequestError, match="without their image"):
        check_images(stray, [], GEMMA)
    with pytest.raises(InvalidRequestError, match="not where it says"):
        check_images(ids, [image(3), image(8)], GEMMA)
    with pytest.raises(InvalidRequestError, match="reads no images"):
        check_images([1, 2], [image(0)], None)


def test_limits_let_an_image_see_itself_whole() -> None:
    limits = image_attention_limits([[image(2)], [], [image(4)]], [0, 5, 5], [7, 2, 4])
    assert limits == [0, 1, 4, 4, 4, 5, 6] + [0, 1] + [1, 1, 2, 3]  # the last: from 4 to 6
    # a pass starting inside an image (its cached part computed whole before)
    assert image_attention_limits([[image(2, 4)]], [4], [3]) == [1, 1, 2]


def _req(prefix: int, spans: list[tuple[int, int]]) -> Req:
    req = Req("r", list(range(40)), SamplingParams())
    req.prefix_indices = torch.zeros(prefix, dtype=torch.int64)
    req.whole_spans = spans
    return req


@pytest.mark.parametrize("prefix,take,expected", [
    (0, 12, 10),   # would end inside [10, 20): back to its start
    (0, 25, 25),   # past it: as asked
    (10, 4, 10),   # starts at the image: on to its end
    (12, 4, 8),    # starts inside it (a cached part): on to its end
    (0, 10, 10),   # ends at its start
    (0, 20, 20),   # ends at its end
])
def test_chunks_never_end_inside_a_whole_span(prefix: int, take: int, expected: int) -> None:
    assert whole_span_take(_req(prefix, [(10, 20), (30, 33)]), take) == expected
    assert whole_span_take(_req(prefix, []), take) == take
