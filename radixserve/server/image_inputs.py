"""A request's images, from what the client sent to the `ImageInput`s the scheduler takes.

Sources, as OpenAI's and vLLM's APIs take them: `data:image/...;base64,` URLs, http(s) URLs
(fetched on the event loop with a timeout and a size cap, `RADIXSERVE_IMAGE_FETCH_TIMEOUT`
seconds, default 10), local files (`file://` URLs or paths) only inside
`--allowed-local-media-path`, bare base64 (SGLang's image_data), and for the offline Engine
PIL images and any local path. Each image is decoded with Pillow, turned into pixels by the
checkpoint's own image processor (transformers' AutoImageProcessor of its folder), and its
placeholder in the prompt expanded to the tokens its features fill (core/multimodal.py).
Anything unreadable is a 400 naming the image."""
from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import dataclasses
import functools
import io
import logging
import os
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixserve.config import DEFAULT_MAX_IMAGES, ServerArgs
from radixserve.core.multimodal import (ImageInput, VisionSpec, bytes_hash,
                                        expand_image_placeholders)
from radixserve.core.sampling_params import InvalidRequestError
from radixserve.server.errors import APIError

logger = logging.getLogger(__name__)

MAX_IMAGE_BYTES = 32 << 20
MAX_IMAGE_PIXELS = 64 << 20  # decoded width x height


def fetch_timeout_s() -> float:
    return float(os.environ.get("RADIXSERVE_IMAGE_FETCH_TIMEOUT", "10"))


@dataclass(frozen=True)
class ImageOptions:
    """The rules for a request's images: --allowed-local-media-path, --limit-mm-per-prompt,
    --allowed-media-domains, --mm-processor-kwargs; the offline Engine trusts any local
    path."""
    allowed_local_media_path: str | None = None
    max_images: int = DEFAULT_MAX_IMAGES
    allowed_domains: frozenset[str] | None = None
    trust_local_paths: bool = False
    # --mm-processor-kwargs: the image processor built with these in place of its config's
    processor_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, args: ServerArgs, trust_local_paths: bool = False) -> "ImageOptions":
        domains = args.allowed_media_domains
        return cls(args.allowed_local_media_path, args.max_images_per_prompt(),
                   None if domains is None else frozenset(d.lower() for d in domains),
                   trust_local_paths, args.image_processor_overrides())


class ImageReader:
    """The model's image processor and placeholder spec, and the rules for image sources."""

    def __init__(self, vision: dict[str, Any], options: ImageOptions = ImageOptions(),
                 tokenizer: Any | None = None) -> None:
        from transformers import AutoImageProcessor

        self.spec = _with_tokenizer_ids(VisionSpec(**{
            field.name: vision[field.name] for field in dataclasses.fields(VisionSpec)}),
            tokenizer)
        try:
            self.processor = AutoImageProcessor.from_pretrained(
                vision["model_path"], **options.processor_overrides)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"the model reads images but its folder {vision['model_path']} "
                             f"has no usable image processor: {exc}") from exc
        # pixels travel and wait in the model's dtype, which its tower casts them to anyway
        # (bf16: half of float32's 9.6 MB for a Gemma-3 image)
        self.pixel_dtype: torch.dtype = getattr(torch, vision.get("dtype") or "float32")
        self.local_root = None if options.allowed_local_media_path is None else \
            Path(options.allowed_local_media_path).resolve()
        self.trust_local_paths = options.trust_local_paths  # the offline Engine: any file
        self.max_images = options.max_images  # a prompt's (--limit-mm-per-prompt)
        self.allowed_domains = options.allowed_domains  # None: any host

    def check_count(self, count: int) -> None:
        """A prompt's images within --limit-mm-per-prompt."""
        if count > self.max_images:
            raise InvalidRequestError(
                "images are refused (--limit-mm-per-prompt)" if not self.max_images else
                f"{count} images in one prompt; at most {self.max_images} "
                "(--limit-mm-per-prompt)", param="image")

    # ---- sources -> bytes ----
    async def fetch(self, sources: list[Any]) -> list[Any]:
        """Each source as bytes (or a PIL image as given); http(s) URLs fetched here, the rest
        (base64 decoding, files) read in a thread, off the event loop."""
        self.check_count(len(sources))
        out = []
        for index, source in enumerate(sources):
            if isinstance(source, str) and source.startswith(("http://", "https://")):
                self._check_host(source, index)
                out.append(await _download(source, index, self.allowed_domains is None))
            else:
                out.append(await asyncio.to_thread(self.read_source, source, index))
        return out

    def read_source(self, source: Any, index: int) -> Any:
        """A source that needs no network: bytes, or a PIL image unchanged."""
        if hasattr(source, "convert") and hasattr(source, "size"):  # a PIL image
            return source
        if isinstance(source, (bytes, bytearray)):
            return bytes(source)
        if not isinstance(source, str) or not source:
            raise _bad(index, "an image must be a URL, a data URL, a path or base64 text")
        if source.startswith("data:"):
            head, _, data = source.partition(",")
            if not head.endswith(";base64"):
                raise _bad(index, "a data URL must be base64 (data:image/...;base64,...)")
            return _b64(data, index)
        if source.startswith(("http://", "https://")):
            self._check_host(source, index)
            return _download_sync(source, index)
        if source.startswith("file://"):
            return self._local(source.removeprefix("file://"), index)
        # a path that exists (base64 text may start with "/": JPEG's "/9j/")
        if len(source) < 4096 and os.path.exists(os.path.expanduser(source)):
            return self._local(os.path.expanduser(source), index)
        return _b64(source, index)

    def _check_host(self, url: str, index: int) -> None:
        """An image URL's host among --allowed-media-domains, where it is given."""
        host = (urllib.parse.urlsplit(url).hostname or "").lower()
        if self.allowed_domains is not None and host not in self.allowed_domains:
            raise _bad(index, f"{host or url!r} is not among --allowed-media-domains")

    def _local(self, path: str, index: int) -> bytes:
        resolved = Path(path).resolve()
        if not self.trust_local_paths and (self.local_root is None or
                                           not resolved.is_relative_to(self.local_root)):
            raise _bad(index, "local files are read only inside --allowed-local-media-path")
        try:
            if resolved.stat().st_size > MAX_IMAGE_BYTES:
                raise _bad(index, f"the file is larger than {MAX_IMAGE_BYTES} bytes")
            return resolved.read_bytes()
        except OSError as exc:
            raise _bad(index, f"cannot read {path}: {exc.strerror}") from None

    # ---- text, bytes -> pixels, placeholders ----
    def expand_text(self, text: str, num_images: int) -> str:
        """A prompt's text as the checkpoint's processor writes it before tokenizing: Gemma-3's
        markers become the image's whole sequence (markers, run, newlines around); others are
        expanded on the ids (`prepare`). Text without images stays as it is."""
        if not num_images or self.spec.image_text is None:
            return text
        return text.replace(self.spec.image_marker, self.spec.image_text)

    def prepare(self, input_ids: list[int], images: list[Any]
                ) -> tuple[list[int], list[ImageInput]]:
        """The prompt with its image placeholders expanded, and each image's input."""
        return self.prepare_many([(input_ids, images)])[0]

    def prepare_many(self, prompts: list[tuple[list[int], list[Any]]]
                     ) -> list[tuple[list[int], list[ImageInput]]]:
        """`prepare` for several prompts, their images decoded and processed in threads (Pillow
        and numpy release the GIL: an image processor's resize of a photo to 896 x 896 is tens
        of milliseconds of one core); then each prompt's markers expanded (Pixtral's spans by
        the processed images' grids)."""
        for _, images in prompts:
            self.check_count(len(images))
        flat = [(index, image) for _, images in prompts for index, image in enumerate(images)]
        if len(flat) > 1:
            processed = list(_pool().map(lambda item: self._pixels_and_key(*item), flat))
        else:
            processed = [self._pixels_and_key(*item) for item in flat]
        out, taken = [], 0
        for ids, images in prompts:
            mine = processed[taken:taken + len(images)]
            taken += len(images)
            grids = [grid for _, grid, _ in mine if grid is not None]
            ids, offsets = expand_image_placeholders(ids, self.spec, len(images), grids)
            out.append((ids, [self._image_input(pixels, grid, key, offset)
                              for (pixels, grid, key), offset in zip(mine, offsets)]))
        return out

    def _image_input(self, pixels: Any, grid: tuple[int, int] | None, key: int,
                     offset: int) -> ImageInput:
        if grid is None:
            return ImageInput(pixels, offset, self.spec.tokens_per_image, key)
        if self.spec.mrope_merge is not None:  # rows x cols tokens at 3-D positions
            return ImageInput(pixels, offset, grid[0] * grid[1], key, thw=(1, *grid))
        return ImageInput(pixels, offset, grid[0] * (grid[1] + 1), key, grid)

    def _pixels_and_key(self, index: int, image: Any) -> tuple[Any, tuple[int, int] | None,
                                                                int]:
        decoded = self.decode(image, index)
        pixels, grid = self.pixels(decoded)
        # keyed by the decoded image (the processor is deterministic), hashed before it grows
        # into float32 pixels
        return pixels, grid, bytes_hash(decoded.tobytes(), (decoded.mode, decoded.size))

    def decode(self, image: Any, index: int) -> Any:
        from PIL import Image, UnidentifiedImageError

        if not isinstance(image, (bytes, bytearray)):
            return image.convert("RGB")
        try:
            with Image.open(io.BytesIO(image)) as opened:
                if opened.width * opened.height > MAX_IMAGE_PIXELS:
                    raise _bad(index, f"{opened.width}x{opened.height} is more than "
                                      f"{MAX_IMAGE_PIXELS} pixels")
                return opened.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) \
                as exc:
            if isinstance(exc, InvalidRequestError):
                raise
            raise _bad(index, f"not a readable image ({type(exc).__name__})") from None

    def pixels(self, image: Any) -> tuple[Any, tuple[int, int] | None]:
        """An image's pixels [3, H, W] in the model's dtype, and for Pixtral's layout its grid
        of feature tokens (the processor sizes the image to whole grid cells of patch x merge
        pixels)."""
        if self.spec.mrope_merge is not None:
            return self._patches(image)
        patch = self.spec.grid_patch
        if patch is None:
            values = self.processor(images=[image], return_tensors="pt")["pixel_values"]
            return torch.as_tensor(values)[0].to(self.pixel_dtype).contiguous(), None
        out = self.processor(images=[image], return_tensors="pt",
                             patch_size={"height": patch, "width": patch})
        height, width = (int(v) for v in out["image_sizes"][0])
        pixels = torch.as_tensor(out["pixel_values"])[0, :, :height, :width]
        return pixels.to(self.pixel_dtype).contiguous(), (height // patch, width // patch)

    def _patches(self, image: Any) -> tuple[Any, tuple[int, int]]:
        """Qwen2-VL's processor: the image resized to whole merge blocks of patches, as rows
        [patches, 3 * temporal_patch * patch * patch], and its grid of image tokens (the patch
        grid over the merge)."""
        out = self.processor(images=[image], return_tensors="pt")
        frames, height, width = (int(v) for v in out["image_grid_thw"][0])
        merge = self.spec.mrope_merge
        assert merge is not None and frames == 1, "a still image is one temporal patch"
        pixels = torch.as_tensor(out["pixel_values"]).to(self.pixel_dtype).contiguous()
        return pixels, (height // merge, width // merge)


@functools.lru_cache(maxsize=1)
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for images' decoding and processing, shared by every reader of the process."""
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="image-prep")


def _with_tokenizer_ids(spec: VisionSpec, tokenizer: Any | None) -> VisionSpec:
    """Pixtral's break and end tokens as the model's tokenizer numbers them, where it has
    them (the config does not say)."""
    if spec.grid_patch is None or tokenizer is None:
        return spec
    ids = [tokenizer.convert_tokens_to_ids(name) for name in ("[IMG_BREAK]", "[IMG_END]")]
    if any(not isinstance(i, int) or i == tokenizer.unk_token_id for i in ids):
        return spec
    return dataclasses.replace(spec, break_token_id=ids[0], end_token_id=ids[1])


async def fetch_images(reader: ImageReader | None, sources: list[Any],
                       param: str) -> list[Any]:
    """A request's images as bytes, downloaded where they are URLs; a model that reads no
    images (`reader` None) refuses any (400s name the request's field `param`, and the bad
    image)."""
    if not sources:
        return []
    if reader is None:
        raise APIError("this model reads no images", param=param)
    try:
        return await reader.fetch(sources)
    except InvalidRequestError as exc:
        raise APIError(str(exc), param=param) from None


def image_reader(vision: dict[str, Any] | None, options: ImageOptions = ImageOptions(),
                 tokenizer: Any | None = None) -> ImageReader | None:
    """The model's ImageReader, or None where it reads no images, or where its folder lacks
    the image processor: then it is served text-only (images refused), said in the log."""
    if not vision:
        return None
    try:
        return ImageReader(vision, options, tokenizer)
    except ValueError as exc:
        logger.warning("%s; serving it text-only (requests with images are refused)", exc)
        return None


def _bad(index: int, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"image {index}: {why}", param="image")


def _b64(data: str, index: int) -> bytes:
    try:
        raw = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise _bad(index, "not a URL, a readable path or base64 image data") from None
    if len(raw) > MAX_IMAGE_BYTES:
        raise _bad(index, f"larger than {MAX_IMAGE_BYTES} bytes")
    return raw


async def _download(url: str, index: int, follow_redirects: bool = True) -> bytes:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=fetch_timeout_s())
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(url, allow_redirects=follow_redirects) as response:
                if response.status != 200:
                    raise _bad(index, f"fetching {url} answered HTTP {response.status}")
                data = await response.content.read(MAX_IMAGE_BYTES + 1)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise _bad(index, f"cannot fetch {url}: {type(exc).__name__} {exc}".strip()) from None
    if len(data) > MAX_IMAGE_BYTES:
        raise _bad(index, f"{url} is larger than {MAX_IMAGE_BYTES} bytes")
    return data


def _download_sync(url: str, index: int) -> bytes:
    """The offline Engine's fetch (no event loop)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=fetch_timeout_s()) as response:
            data = response.read(MAX_IMAGE_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise _bad(index, f"cannot fetch {url}: {exc}") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise _bad(index, f"{url} is larger than {MAX_IMAGE_BYTES} bytes")
    return data


def per_prompt_images(image_data: Any, num_prompts: int | None) -> list[list[Any]]:
    """SGLang's image_data: for one prompt (`num_prompts` None) an image or a list of them;
    for a batch one such item per prompt."""
    items = [image_data] if num_prompts is None else image_data
    if num_prompts is not None and image_data is None:
        items = [None] * num_prompts
    elif num_prompts is not None and (not isinstance(image_data, list) or
                                      len(image_data) != num_prompts):
        raise InvalidRequestError(f"image_data must hold one item per prompt ({num_prompts})",
                                  param="image_data")
    return [[] if item is None else list(item) if isinstance(item, list) else [item]
            for item in items]


def conversation_images(conversation: list[Any], marker: str | None, as_parts: bool
                        ) -> tuple[list[Any], list[Any]]:
    """An offline chat's messages as the template takes them, and their images in order.
    Image parts are OpenAI's {"type": "image_url", "image_url": {"url"}} and vLLM's
    {"type": "image_pil", "image_pil": <PIL image>} / {"type": "image", "image": ...}; each
    becomes {"type": "image"} (`as_parts`) or `marker` in the text; `marker` None: the model
    reads no images and any image part is refused."""
    images: list[Any] = []
    messages = []
    for message in conversation:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str) and as_parts and marker is not None:
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            messages.append(message)
            continue
        parts: list[dict[str, Any]] = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image_url", "image_pil", "image"):
                if marker is None:
                    raise InvalidRequestError("this model reads no images (a content part "
                                              f"of type {kind!r})")
                image = part.get(kind)
                images.append(image.get("url") if isinstance(image, dict) else image)
                parts.append({"type": "image"} if as_parts else {"type": "text", "text": marker})
            elif kind in (None, "text"):
                parts.append(part)
            else:
                raise InvalidRequestError(f"content parts of type {kind!r} are not supported; "
                                          "only text and images")
        if not as_parts:  # text templates: the parts joined
            parts_text = "".join(str(p.get("text", "")) for p in parts)
            messages.append({**message, "content": parts_text})
        else:
            messages.append({**message, "content": parts})
    return messages, images
