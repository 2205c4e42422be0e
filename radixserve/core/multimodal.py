"""Images in a prompt, as every layer below the server sees them.

The server turns each image of a request into an `ImageInput`: its pixels (the checkpoint's
image processor's output) and the run of placeholder tokens it fills in the prompt (`offset`,
`num_tokens`). The scheduler keeps them on the request and hands the ones of an extend pass to
the model, which runs its vision encoder on them and writes the image's features over the
placeholders' embeddings. `hash` keys both the prefix cache (two prompts share cached KV
through an image only if it is the same image) and the model's cache of encoded images (a
prompt chunked over several passes encodes each image once).

`VisionSpec` reads from a checkpoint's config what the server needs to expand a prompt's
image markers: the placeholder token and how many of them one image fills."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.core.sampling_params import InvalidRequestError


@dataclass
class ImageInput:
    # [3, height, width] as the image processor made it, in the model's dtype
    pixel_values: torch.Tensor
    offset: int  # the prompt position of its first placeholder token
    num_tokens: int  # placeholder tokens it spans, from offset on
    hash: int  # 63-bit digest of its pixels
    # Pixtral's layout (Mistral3): (rows, cols) of feature tokens, the span then being each
    # row's cols image tokens and a break token, the last row's an end token; None: every
    # token of the span is a feature row
    grid: tuple[int, int] | None = None
    # M-RoPE models (Qwen2-VL, Qwen2.5-VL): (frames, rows, cols) of its feature tokens, which
    # fill the span row-major and take 3-D rope positions (`mrope_positions`); None elsewhere
    thw: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.grid is not None and self.num_tokens != self.grid[0] * (self.grid[1] + 1):
            raise ValueError(f"a {self.grid[0]} x {self.grid[1]} grid spans "
                             f"{self.grid[0] * (self.grid[1] + 1)} tokens, not "
                             f"{self.num_tokens}")

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    @property
    def rope_delta(self) -> int:
        """How far the positions of the tokens after the image trail their index: an M-RoPE
        image spans max(rows, cols) positions for its rows x cols tokens (0 elsewhere)."""
        if self.thw is None:
            return 0
        return max(self.thw[1], self.thw[2]) - self.num_tokens

    @property
    def num_features(self) -> int:
        """Feature rows the image has (its image tokens)."""
        return self.num_tokens if self.grid is None else self.grid[0] * self.grid[1]

    def feature_index(self, position: int) -> int | None:
        """The feature row at prompt `position` of the span, None at a break / end token."""
        j = position - self.offset
        if self.grid is None:
            return j
        row, col = divmod(j, self.grid[1] + 1)
        return None if col == self.grid[1] else row * self.grid[1] + col


def pixels_hash(pixel_values: torch.Tensor) -> int:
    """A 63-bit digest of an image's pixels (and shape): equal images, equal hashes."""
    data = pixel_values.detach().to(torch.float32).contiguous().cpu()
    return bytes_hash(data.numpy().tobytes(), tuple(data.shape))


def bytes_hash(data: bytes, shape: tuple[Any, ...]) -> int:
    """A 63-bit digest of an image's bytes (decoded, before the image processor: far fewer
    than its float32 pixels, 1 MB against 9.6 MB for a 640 x 480 photo at Gemma-3's 896 x 896)
    and their shape."""
    digest = hashlib.blake2b(data, digest_size=8)
    digest.update(repr(shape).encode())
    return int.from_bytes(digest.digest(), "little") >> 1


def image_key_tokens(image: ImageInput) -> list[int]:
    """The prefix cache's key for an image's placeholders: ids far past every token id (and
    apart from LoRA's offsets, multiples of 2**32 below 2**97), one per position within the
    image, unique to its pixels."""
    base = ((image.hash + 1) << 100) + (1 << 31)
    return [base + i for i in range(image.num_tokens)]


QWEN_VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration",
                         "Qwen2_5_VLForConditionalGeneration",
                         "Qwen3VLForConditionalGeneration",
                         "Qwen3VLMoeForConditionalGeneration",
                         "Qwen3_5ForConditionalGeneration",
                         "Qwen3_5MoeForConditionalGeneration")
# what Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's and Qwen3.5's chat templates write for an image
QWEN_VL_IMAGE_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass(frozen=True)
class VisionSpec:
    """What a multimodal checkpoint's config says about its image placeholders."""
    image_token_id: int  # the token each image's features replace
    tokens_per_image: int  # how many of them one image fills
    image_marker: str  # the text a chat template writes for one image
    # Gemma-3: the marker is a token of its own (<start_of_image>) that the processor's text
    # replaces, before tokenizing, by `image_text` (the marker, the run of image tokens, an end
    # token, newlines around); from ids, a marker not followed by its run gets the run and
    # `end_token_id` after it. None: the marker is the image token itself (LLaVA's <image>)
    marker_token_id: int | None = None
    image_text: str | None = None
    end_token_id: int | None = None
    # an image's tokens attend to each other both ways, the rest causally (Gemma-3): an
    # extend pass must hold the whole image (image_attention_limits)
    bidirectional: bool = False
    # Pixtral's layout (Mistral3): an image's size decides its grid of feature tokens, one per
    # grid_patch x grid_patch pixels (the patch times the spatial merge), each row followed by
    # a break token, the last by `end_token_id` (tokens_per_image 0: it varies)
    grid_patch: int | None = None
    break_token_id: int | None = None
    # M-RoPE (Qwen2-VL, Qwen2.5-VL): the image token is one image's marker, made a run of
    # rows x cols image tokens, one per mrope_merge x mrope_merge patches of the processed
    # image (tokens_per_image 0: it varies); its tokens take 3-D rope positions
    mrope_merge: int | None = None

    @property
    def sized_by_image(self) -> bool:
        """An image's span follows its processed size (Pixtral's rows, M-RoPE's grid)."""
        return self.grid_patch is not None or self.mrope_merge is not None


def vision_spec(hf_config: Any, architecture: str) -> VisionSpec | None:
    """The spec of a checkpoint whose images are served (LLaVA-1.5 style: one fixed-size image
    = a grid of patch features; Gemma-3: a pooled grid between its markers), None for any
    other."""
    if architecture == "Gemma3ForConditionalGeneration":
        tokens = int(hf_config.mm_tokens_per_image)
        image, boi, eoi = "<image_soft_token>", "<start_of_image>", "<end_of_image>"
        return VisionSpec(int(hf_config.image_token_id), tokens, boi,
                          int(hf_config.boi_token_id), f"\n\n{boi}{image * tokens}{eoi}\n\n",
                          int(hf_config.eoi_token_id), bidirectional=True)
    if architecture == "Mistral3ForConditionalGeneration":
        if getattr(hf_config.get_text_config(), "model_type", "mistral") != "mistral":
            return None  # Mistral Small 4's decoder: served text-only
        merge = int(getattr(hf_config, "spatial_merge_size", 1) or 1)
        image = getattr(hf_config, "image_token_id", None)
        image = getattr(hf_config, "image_token_index", 10) if image is None else image
        # [IMG_BREAK] and [IMG_END] of Mistral's tekken tokenizer (the reader takes the
        # tokenizer's own where it has one)
        return VisionSpec(int(image), 0, "[IMG]", end_token_id=13,
                          grid_patch=int(hf_config.vision_config.patch_size) * merge,
                          break_token_id=12)
    if architecture in QWEN_VL_ARCHITECTURES:
        return VisionSpec(int(hf_config.image_token_id), 0, QWEN_VL_IMAGE_MARKER,
                          mrope_merge=int(hf_config.vision_config.spatial_merge_size))
    if architecture != "LlavaForConditionalGeneration":
        return None
    vision = hf_config.vision_config
    if getattr(vision, "model_type", None) == "pixtral":  # pixtral-12b: Pixtral's layout
        image = getattr(hf_config, "image_token_id", None)
        image = getattr(hf_config, "image_token_index", 10) if image is None else image
        return VisionSpec(int(image), 0, "[IMG]", end_token_id=13,
                          grid_patch=int(vision.patch_size), break_token_id=12)
    patches = (vision.image_size // vision.patch_size) ** 2
    strategy = getattr(hf_config, "vision_feature_select_strategy", "default")
    class_token = 1 if getattr(vision, "model_type", "clip_vision_model") == \
        "clip_vision_model" else 0
    # the tower's sequence (patches, CLIP's class token first); "default" drops its first
    tokens = patches + class_token - (1 if strategy == "default" else 0)
    image_token = getattr(hf_config, "image_token_id", None)
    if image_token is None:
        image_token = getattr(hf_config, "image_token_index", 32000)
    return VisionSpec(int(image_token), tokens, "<image>")


def expand_image_placeholders(input_ids: list[int], spec: VisionSpec, num_images: int,
                              grids: list[tuple[int, int]] | None = None
                              ) -> tuple[list[int], list[int]]:
    """The prompt with each image's placeholder run at full length, and each run's offset.

    A run of the image token that is a whole number of images long is taken as written
    (prompts whose placeholders are expanded already); any other run is, where the image token
    is the marker (LLaVA), that many markers of one token each, each made `tokens_per_image`
    long. Where the marker is a token of its own (Gemma-3), a marker not followed by a run gets
    one and the end token after it. Pixtral's layout (`spec.grid_patch`): each image token is
    one image's marker, made its grid's rows (`grids`, in order) of image tokens and breaks.
    The images must be as many as the runs."""
    if spec.sized_by_image:
        return _expand_grids(input_ids, spec, num_images, grids or [])
    image, size, marker = spec.image_token_id, spec.tokens_per_image, spec.marker_token_id
    out: list[int] = []
    offsets: list[int] = []
    i = 0
    while i < len(input_ids):
        token = input_ids[i]
        if token == marker and input_ids[i + 1:i + 1 + size] != [image] * size:
            out.append(token)
            offsets.append(len(out))
            out.extend([image] * size)
            if spec.end_token_id is not None:
                out.append(spec.end_token_id)
            i += 1
            continue
        if token != image:
            out.append(token)
            i += 1
            continue
        end = i
        while end < len(input_ids) and input_ids[end] == image:
            end += 1
        run = end - i
        if run % size and marker is not None:  # no marker: check_images refuses it
            out.extend(input_ids[i:end])
        for _ in range(run // size if run % size == 0 else 0 if marker is not None else run):
            offsets.append(len(out))
            out.extend([image] * size)
        i = end
    _check_count(len(offsets), num_images, spec)
    return out, offsets


def grid_tokens(spec: VisionSpec, grid: tuple[int, int]) -> list[int]:
    """Pixtral's span of one image: each row's image tokens and a break, the last an end; an
    M-RoPE image's: rows x cols image tokens."""
    rows, cols = grid
    if spec.mrope_merge is not None:
        return [spec.image_token_id] * (rows * cols)
    assert spec.break_token_id is not None and spec.end_token_id is not None
    tokens = ([spec.image_token_id] * cols + [spec.break_token_id]) * rows
    tokens[-1] = spec.end_token_id
    return tokens


def _expand_grids(input_ids: list[int], spec: VisionSpec, num_images: int,
                  grids: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    image = spec.image_token_id
    markers = [i for i, token in enumerate(input_ids) if token == image]
    _check_count(len(markers), num_images, spec)
    if spec.grid_patch is not None and (spec.break_token_id in input_ids or
                                        spec.end_token_id in input_ids):
        raise InvalidRequestError(f"write one {spec.image_marker!r} per image: the server lays "
                                  "out its rows", param="prompt")
    out: list[int] = []
    offsets: list[int] = []
    start = 0
    for marker, grid in zip(markers, grids):
        out.extend(input_ids[start:marker])
        offsets.append(len(out))
        out.extend(grid_tokens(spec, grid))
        start = marker + 1
    out.extend(input_ids[start:])
    return out, offsets


def _check_count(found: int, num_images: int, spec: VisionSpec) -> None:
    if found != num_images:
        raise InvalidRequestError(
            f"the prompt has {found} image placeholder(s) ({spec.image_marker!r}) for "
            f"{num_images} image(s)", param="prompt")


def check_images(input_ids: list[int], images: list[ImageInput],
                 spec: VisionSpec | None) -> None:
    """A request's images against its prompt: a model that reads images, each image's run of
    placeholders where it says, in order, and no placeholder without its image."""
    if not images and (spec is None or spec.image_token_id not in input_ids):
        return
    if spec is None:
        raise InvalidRequestError("the model reads no images", param="image_data")
    end = 0
    for image in images:
        if spec.mrope_merge is not None:
            expected = math.prod(image.thw) if image.thw else -1
        elif spec.grid_patch is not None:
            expected = image.grid[0] * (image.grid[1] + 1) if image.grid else -1
        else:
            expected = spec.tokens_per_image
        if image.offset < end or image.num_tokens != expected or image.end > len(input_ids) or \
                input_ids[image.offset:image.end].count(spec.image_token_id) != \
                image.num_features:
            raise InvalidRequestError("an image's placeholder tokens are not where it says",
                                      param="image_data")
        end = image.end
    if input_ids.count(spec.image_token_id) != sum(image.num_features for image in images):
        raise InvalidRequestError(
            f"the prompt has image placeholder tokens ({spec.image_token_id}) without their "
            "image", param="prompt")


def image_attention_limits(mm_inputs: list[list[ImageInput]], prefix_lens: list[int],
                           extend_lens: list[int]) -> list[int]:
    """For models whose image tokens see their whole image (Gemma-3: causal, or within the
    same image): per token of an extend pass, the last of its request's new tokens it may
    attend to, as an index into that request's extend tokens (its own index when causal; an
    image token's: its image's last). A pass never ends inside such an image (the scheduler's
    chunks stop before or after one)."""
    limits: list[int] = []
    for images, prefix_len, extend_len in zip(mm_inputs, prefix_lens, extend_lens):
        own = list(range(extend_len))
        for image in images:
            first = max(image.offset - prefix_len, 0)
            last = min(image.end - prefix_len, extend_len) - 1
            if first <= last:  # (an image wholly before or after the pass: nothing)
                own[first:last + 1] = [last] * (last + 1 - first)
        limits.extend(own)
    return limits


def mrope_positions(mm_inputs: list[list[ImageInput]], prefix_lens: list[int],
                    extend_lens: list[int], offsets: list[int]) -> torch.Tensor:
    """M-RoPE's (temporal, row, column) positions [3, T] of an extend pass's tokens (Qwen2-VL's
    `get_rope_index`): a text token at prompt index p sits at p plus the `rope_delta` of every
    image before it (the same in all three rows); an image's token at (t, r, c) of its grid at
    the image's start position plus t, r and c. `offsets[i]`: request i's shift at the pass's
    first token (the deltas of its images that end before it, `ForwardBatch.position_offsets`);
    `mm_inputs[i]`: its images the pass covers (with `thw`)."""
    parts = []
    for images, prefix_len, extend_len, shift in zip(mm_inputs or [[]] * len(prefix_lens),
                                                      prefix_lens, extend_lens, offsets):
        own = (torch.arange(prefix_len, prefix_len + extend_len) + shift).expand(3, -1).clone()
        for image in sorted(images, key=lambda image: image.offset):
            if image.thw is None:
                continue
            start = image.offset + shift  # the position of its first token
            first, end = max(image.offset, prefix_len), min(image.end, prefix_len + extend_len)
            if first < end:
                _, rows, cols = image.thw
                within = torch.arange(first - image.offset, end - image.offset)
                own[0, first - prefix_len:end - prefix_len] = start + within // (rows * cols)
                own[1, first - prefix_len:end - prefix_len] = start + within // cols % rows
                own[2, first - prefix_len:end - prefix_len] = start + within % cols
            own[:, max(image.end - prefix_len, 0):] += image.rope_delta
            shift += image.rope_delta
        parts.append(own)
    return torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.int64)
