"""What images cost a multimodal model: the same batch of requests through the Engine with one
image each (its placeholders in the prompt) and as text of the same length, on random weights
of a config folder holding the checkpoint's preprocessor_config.json (default: Gemma-3 4B's,
benchmarks/configs/gemma-3-4b-it: 896 x 896 SigLIP-So400m, 256 tokens an image, seen both
ways; or benchmarks/configs/qwen2.5-vl-7b-instruct: a 640 x 480 photo is 46 x 34 patches of
14, 391 tokens at 3-D rope positions); and the vision tower + projector alone per image.

    python3 benchmarks/image_throughput.py --num-requests 64 --output-len 32     # a GPU
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import radixserve  # noqa: E402
from radixserve.core.multimodal import vision_spec  # noqa: E402

DEFAULT_MODEL = str(Path(__file__).resolve().parent / "configs" / "gemma-3-4b-it")


def noise_images(count: int, seed: int) -> list:
    from PIL import Image
    gen = torch.Generator().manual_seed(seed)
    return [Image.fromarray(torch.randint(0, 256, (480, 640, 3), generator=gen,
                                          dtype=torch.uint8).numpy(), "RGB")
            for _ in range(count)]


def timed_generate(engine: radixserve.Engine, prompts: list[list[int]], output_len: int,
                   images: list | None) -> float:
    params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=params,
                    image_data=None if images is None else [[image] for image in images])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--text-len", type=int, default=128, help="text tokens a prompt")
    parser.add_argument("--output-len", type=int, default=32)
    args = parser.parse_args()
    engine = radixserve.Engine(args.model_path, load_format="dummy", dtype=args.dtype,
                               skip_tokenizer_init=True)
    config = engine._runner.model_config
    spec = vision_spec(config.hf_top, config.architecture)
    assert spec is not None, "the model reads no images"
    marker = spec.marker_token_id if spec.marker_token_id is not None else spec.image_token_id
    gen = torch.Generator().manual_seed(0)

    special = {marker, spec.image_token_id, spec.end_token_id}

    def text(n: int) -> list[int]:
        ids = torch.randint(10, min(1000, config.vocab_size), (n,), generator=gen).tolist()
        return [11 if token in special else token for token in ids]

    half = args.text_len // 2
    with_images = [text(half) + [marker] + text(args.text_len - half)
                   for _ in range(args.num_requests)]
    reader = engine._images  # the host's part: decode, the image processor, the pixels' hash
    # the marker's expansion for one 640 x 480 photo (all the same size): the image's span
    # and its markers
    _, sample = reader.prepare([marker], noise_images(1, 98))
    extra = sample[0].num_tokens + (2 if spec.end_token_id is not None else 0)
    as_text = [text(args.text_len + extra) for _ in range(args.num_requests)]
    timed_generate(engine, as_text[:4], 4, None)  # warm-up: kernels, graphs, the tower
    timed_generate(engine, with_images[:4], 4, noise_images(4, 99))
    text_s = timed_generate(engine, as_text, args.output_len, None)
    image_s = timed_generate(engine, with_images, args.output_len,
                             noise_images(args.num_requests, 1))
    start = time.perf_counter()
    batch = [reader.prepare([marker], [image])[1][0] for image in noise_images(8, 2)]
    prepare_ms = (time.perf_counter() - start) / 8 * 1e3
    model = engine._runner.model
    model.encode_group(batch)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(3):
        model.encode_group(batch)
    sync()
    encode_ms = (time.perf_counter() - start) / 24 * 1e3
    engine.shutdown()
    out_tokens = args.num_requests * args.output_len
    result = {"num_requests": args.num_requests, "prompt_tokens": args.text_len + extra,
              "tokens_per_image": sample[0].num_tokens, "output_len": args.output_len,
              "text_only_s": round(text_s, 3), "with_images_s": round(image_s, 3),
              "text_only_out_tok_per_s": round(out_tokens / text_s, 1),
              "with_images_out_tok_per_s": round(out_tokens / image_s, 1),
              "images_per_s": round(args.num_requests / image_s, 1),
              "encode_ms_per_image_batch8": round(encode_ms, 2),
              "host_prepare_ms_per_image": round(prepare_ms, 2)}
    print(f"as text:     {text_s:7.2f} s  {out_tokens / text_s:8.1f} out tok/s")
    print(f"with images: {image_s:7.2f} s  {out_tokens / image_s:8.1f} out tok/s "
          f"({text_s / image_s:.2f}x the text's)")
    print(f"vision tower + projector: {encode_ms:.2f} ms an image (batches of 8); host "
          f"(decode, image processor, hash): {prepare_ms:.2f} ms an image")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
