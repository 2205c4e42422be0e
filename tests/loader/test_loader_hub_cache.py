"""`--model-path org/name` through huggingface_hub: the local hub cache first (offline), a
download only when not cached. Fully offline: the hub cache is laid out here exactly as
huggingface_hub writes it (blobs/ + snapshot symlinks + refs/main), and the network paths are
exercised with a stand-in for `huggingface_hub.snapshot_download`."""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

from radixserve.loader.model_resolution import (HUB_ALLOW_PATTERNS, HUB_BIN_PATTERNS,
                                                resolve_model_path)
from radixserve.loader.model_source import load_model_source
from radixserve.loader.weight_files import weight_files

from loader_test_utils import write_bin_twin

REPO_ID = "org/name"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REAL_SNAPSHOT_DOWNLOAD = huggingface_hub.snapshot_download


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama saved by transformers (config.json, generation_config.json,
    model.safetensors)."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256)
    folder = tmp_path_factory.mktemp("tiny-llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))
    return folder


def _blob_id(path: Path) -> str:
    """The name huggingface_hub gives a blob: its etag, the sha256 for LFS files (weights),
    the git blob sha1 for small files."""
    data = path.read_bytes()
    if path.suffix in (".safetensors", ".bin"):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_to_hub_cache(cache: Path, repo_id: str, files: list[Path], commit: str = COMMIT,
                     refs: tuple[str, ...] = ("main",)) -> Path:
    """Lay `files` out in `cache` as huggingface_hub does; return the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for src in files:
        blob = repo / "blobs" / _blob_id(src)
        blob.write_bytes(src.read_bytes())
        link = snapshot / src.name
        if not link.is_symlink():  # a file cached before stays, as with huggingface_hub
            link.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)  # no trailing newline, as the hub writes it
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache that huggingface_hub uses, with the hub forced offline (tests that
    exercise the online path turn it back on and stub snapshot_download)."""
    cache = tmp_path / "hf-hub-cache"
    cache.mkdir()
    # constants are read from the environment once, at import: patch the module values
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))  # for anything that reads the env later
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.fixture
def cached_repo(hub_cache: Path, tiny_checkpoint: Path) -> Path:
    return add_to_hub_cache(hub_cache, REPO_ID, sorted(tiny_checkpoint.iterdir()))


def test_repo_id_resolves_to_cached_snapshot(cached_repo: Path) -> None:
    resolved = resolve_model_path(REPO_ID)
    assert resolved.kind == "hf" and resolved.name == REPO_ID and not resolved.is_bundled
    assert Path(resolved.path) == cached_repo
    assert [Path(f).name for f in weight_files(resolved.path)] == ["model.safetensors"]
    # a pinned commit, as org/name@rev or as the revision argument, finds the same snapshot
    assert resolve_model_path(f"{REPO_ID}@{COMMIT}") == resolved
    assert resolve_model_path(REPO_ID, revision=COMMIT) == resolved


def test_cached_repo_loads_as_model_source(cached_repo: Path, tiny_checkpoint: Path) -> None:
    from safetensors.torch import load_file

    source = load_model_source(REPO_ID)
    assert source.format == "safetensors" and source.served_model_name == REPO_ID
    assert Path(source.model_path) == cached_repo
    assert source.model_config.num_hidden_layers == 1 and source.model_config.vocab_size == 128
    expected = load_file(tiny_checkpoint / "model.safetensors")
    got = dict(source.weights())
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)


def test_model_runner_builds_from_repo_id(cached_repo: Path, tiny_checkpoint: Path) -> None:
    from safetensors.torch import load_file

    from radixserve.config import ServerArgs
    from radixserve.executor.model_runner import ModelRunner

    expected = load_file(tiny_checkpoint / "model.safetensors")
    t0 = time.perf_counter()
    runner = ModelRunner(ServerArgs(model_path=REPO_ID, device="cpu", dtype="float32",
                                    max_total_tokens=256, max_running_requests=4))
    print(f"ModelRunner built from {REPO_ID} in {time.perf_counter() - t0:.1f} s")
    assert runner.source.served_model_name == REPO_ID
    params = dict(runner.model.named_parameters())
    embed = next(p for n, p in params.items() if n.endswith("embed_tokens.weight"))
    torch.testing.assert_close(embed, expected["model.embed_tokens.weight"], rtol=0, atol=0)


def test_uncached_repo_offline_names_repo_and_offline_flag(hub_cache: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_path("other-org/missing-model")
    message = str(info.value)
    assert "other-org/missing-model" in message and "HF_HUB_OFFLINE" in message
    assert str(hub_cache) in message and "hf download other-org/missing-model" in message


def test_local_folder_shaped_like_repo_id_wins(cached_repo: Path, tmp_path: Path,
                                               tiny_checkpoint: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    local = tmp_path / "work" / "org" / "name"
    local.mkdir(parents=True)
    (local / "config.json").write_bytes((tiny_checkpoint / "config.json").read_bytes())
    monkeypatch.chdir(tmp_path / "work")
    resolved = resolve_model_path(REPO_ID)
    assert Path(resolved.path) == local.resolve() and resolved.kind == "hf"
    assert resolved.name == "name"  # a local folder keeps its folder name, as before


def _stub_snapshot_download(monkeypatch: pytest.MonkeyPatch, online: object) -> list[dict]:
    """Route online calls to `online` (an exception to raise, or a callable returning the
    folder); cache look-ups (local_files_only=True) go to the real function. Hub online."""
    calls: list[dict] = []

    def fake(repo_id: str, **kwargs: object) -> str:
        calls.append(dict(kwargs, repo_id=repo_id))
        if kwargs.get("local_files_only"):
            return REAL_SNAPSHOT_DOWNLOAD(repo_id, **kwargs)
        if isinstance(online, BaseException):
            raise online
        return online(repo_id, **kwargs)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    return calls


def test_cache_hit_makes_no_online_call(cached_repo: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _stub_snapshot_download(monkeypatch, AssertionError("went online"))
    assert Path(resolve_model_path(REPO_ID).path) == cached_repo
    assert [c["local_files_only"] for c in calls] == [True]


def test_not_cached_and_online_downloads_what_we_load(hub_cache: Path, tiny_checkpoint: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def download(repo_id: str, **kwargs: object) -> str:
        return str(add_to_hub_cache(hub_cache, repo_id, sorted(tiny_checkpoint.iterdir())))

    calls = _stub_snapshot_download(monkeypatch, download)
    resolved = resolve_model_path(REPO_ID)
    assert resolved.kind == "hf" and resolved.name == REPO_ID
    assert [c.get("local_files_only", False) for c in calls] == [True, False]
    online = calls[1]
    assert online["revision"] == "main" and online["repo_id"] == REPO_ID
    patterns = online["allow_patterns"]
    assert patterns == list(HUB_ALLOW_PATTERNS)
    for needed in ("config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer.json",
                   "tokenizer_config.json", "tokenizer.model", "chat_template.jinja"):
        assert needed in patterns
    assert not any("gguf" in p or "bin" in p or "*" == p for p in patterns)


def _http_404() -> object:
    try:
        import httpx2 as httpx  # what this huggingface_hub version builds on
    except ImportError:
        import httpx
    url = f"https://huggingface.co/api/models/{REPO_ID}"
    return httpx.Response(404, request=httpx.Request("GET", url))


@pytest.mark.parametrize("case", ["repo-not-found", "no-network"])
def test_hub_errors_name_the_fix(case: str, hub_cache: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if case == "repo-not-found":
        error: Exception = RepositoryNotFoundError("404 Client Error. Repository Not Found",
                                                   response=_http_404())
        expected = ["no repository", "hf auth login"]
    else:
        error = LocalEntryNotFoundError("An error happened while trying to locate the files on "
                                        "the Hub ... check your internet connection")
        error.__cause__ = ConnectionError("Name or service not known")
        expected = ["could not be reached", "Name or service not known", str(hub_cache),
                    f"hf download {REPO_ID}"]
    _stub_snapshot_download(monkeypatch, error)
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_path(REPO_ID)
    message = str(info.value)
    for part in [REPO_ID, "local folder", *expected]:
        assert part in message
    assert info.value.__cause__ is error  # chained, never a bare hub traceback


def test_gguf_only_repo_is_out_of_scope(hub_cache: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # online: the allow_patterns filter leaves nothing, so the snapshot has no config.json
    def download(repo_id: str, **kwargs: object) -> str:
        folder = hub_cache / "models--org--gguf-only" / "snapshots" / COMMIT
        folder.mkdir(parents=True)
        return str(folder)

    _stub_snapshot_download(monkeypatch, download)
    with pytest.raises(ValueError, match="GGUF-only"):
        resolve_model_path("org/gguf-only")


def test_invalid_ids_and_missing_paths_keep_the_local_error(hub_cache: Path) -> None:
    for path in ("not-here", "a/b/c", "org/na--me", "./nowhere/x/y", "org/name@"):
        with pytest.raises(FileNotFoundError, match="does not exist locally"):
            resolve_model_path(path)
    with pytest.raises(ValueError, match="revision"):
        resolve_model_path(f"{REPO_ID}@v1", revision="v2")


@pytest.fixture(scope="module")
def tiny_bin_checkpoint(tiny_checkpoint: Path) -> Path:
    """tiny_checkpoint's weights as pytorch_model-0000X-of-0000N.bin shards and their index."""
    return write_bin_twin(tiny_checkpoint, tiny_checkpoint.parent / "tiny-bin", "20KB")


def _hub_repo(hub_cache: Path, remote: list[Path]) -> object:
    """A stand-in for the online snapshot_download of a repo holding `remote`: it caches the
    files its allow_patterns select, as huggingface_hub does."""
    from huggingface_hub.utils import filter_repo_objects

    def download(repo_id: str, **kwargs: object) -> str:
        chosen = filter_repo_objects(remote, allow_patterns=kwargs["allow_patterns"],
                                     key=lambda path: path.name)
        return str(add_to_hub_cache(hub_cache, repo_id, list(chosen)))
    return download


def test_bin_weights_are_downloaded_only_from_a_repo_without_safetensors(
        hub_cache: Path, tiny_checkpoint: Path, tiny_bin_checkpoint: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    both = sorted(tiny_checkpoint.iterdir()) + sorted(tiny_bin_checkpoint.glob("pytorch_*"))
    calls = _stub_snapshot_download(monkeypatch, _hub_repo(hub_cache, both))
    snapshot = Path(resolve_model_path("org/both").path)
    assert [c.get("local_files_only", False) for c in calls] == [True, False]
    assert (snapshot / "model.safetensors").is_file() and not list(snapshot.glob("*.bin*"))

    calls = _stub_snapshot_download(
        monkeypatch, _hub_repo(hub_cache, sorted(tiny_bin_checkpoint.iterdir())))
    source = load_model_source(REPO_ID)
    assert [c.get("local_files_only", False) for c in calls] == [True, False, False]
    assert calls[1]["allow_patterns"] == list(HUB_ALLOW_PATTERNS)
    assert calls[2]["allow_patterns"] == [*HUB_ALLOW_PATTERNS, *HUB_BIN_PATTERNS]
    assert source.format == "pt" and source.served_model_name == REPO_ID
    shards = sorted(p.name for p in Path(source.model_path).glob("*.bin"))
    assert len(shards) > 1 and shards == sorted(p.name for p in tiny_bin_checkpoint.glob("*.bin"))
    from safetensors.torch import load_file
    expected = load_file(tiny_checkpoint / "model.safetensors")
    got = dict(source.weights())
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], tensor) for name, tensor in expected.items())


def test_a_cached_bin_snapshot_is_complete_with_every_shard_its_index_names(
        hub_cache: Path, tiny_bin_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = sorted(tiny_bin_checkpoint.iterdir())
    snapshot = add_to_hub_cache(hub_cache, REPO_ID, files)
    calls = _stub_snapshot_download(monkeypatch, AssertionError("went online"))
    assert Path(resolve_model_path(REPO_ID).path) == snapshot
    assert len(calls) == 1
    lost = sorted(snapshot.glob("pytorch_model-*.bin"))[1]
    lost.unlink()
    calls = _stub_snapshot_download(monkeypatch, _hub_repo(hub_cache, files))
    assert Path(resolve_model_path(REPO_ID).path) == snapshot and lost.is_file()
    assert [c.get("local_files_only", False) for c in calls] == [True, False, False]
