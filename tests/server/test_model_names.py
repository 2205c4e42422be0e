"""Which `model` names the OpenAI routes accept and report (server/launch.py)."""
from __future__ import annotations

from radixserve.config import ServerArgs
from radixserve.server.launch import accepted_model_names, served_model_name


def test_a_served_model_name_is_the_only_name_requests_may_use() -> None:
    """--served-model-name replaces the path as an accepted `model` (vLLM's rule); without it
    the model's name and the path as given are both accepted."""
    named = ServerArgs(model_path="/models/llama", served_model_name="prod-llm")
    assert accepted_model_names(named, "llama") == {"prod-llm"}
    assert accepted_model_names(ServerArgs(model_path="/models/llama/"), "llama") == {
        "llama", "/models/llama/"}


def test_a_hub_model_is_served_as_its_repo_id() -> None:
    """org/name@revision is served as org/name (the resolved model's name), as vLLM and
    SGLang report hub models; the path as given is accepted too."""
    args = ServerArgs(model_path="myorg/tiny-llama@0123abc")
    assert served_model_name(args, "myorg/tiny-llama") == "myorg/tiny-llama"
    assert accepted_model_names(args, "myorg/tiny-llama") == {"myorg/tiny-llama",
                                                              "myorg/tiny-llama@0123abc"}
