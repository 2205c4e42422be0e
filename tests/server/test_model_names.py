"""Which `model` names the OpenAI routes accept (server/launch.accepted_model_names)."""
from __future__ import annotations


def test_a_served_model_name_is_the_only_name_requests_may_use() -> None:
    """--served-model-name replaces the path as an accepted `model` (vLLM's rule); without it
    the served name (the path's last part) and the path as given are both accepted."""
    from radixserve.config import ServerArgs
    from radixserve.server.launch import accepted_model_names
    named = ServerArgs(model_path="/models/llama", served_model_name="prod-llm")
    assert accepted_model_names(named) == {"prod-llm"}
    assert accepted_model_names(ServerArgs(model_path="/models/llama/")) == {"llama",
                                                                            "/models/llama/"}
