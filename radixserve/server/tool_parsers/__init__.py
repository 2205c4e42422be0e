"""Tool-call parsers of /v1/chat/completions: one small file per model format (hermes.py for
Qwen2.5/Qwen3/Hermes `<tool_call>...</tool_call>`, llama3.py for Llama 3.1/3.2 JSON,
mistral.py for `[TOOL_CALLS] [...]`, deepseek.py for DeepSeek-V3 / R1 and V3.1's
`<｜tool▁calls▁begin｜>...`), the registry that picks one (`--tool-call-parser` or the
chat template's text), the grammar that forces a call (`tool_choice` required or named) and
the streaming state that turns growing text into OpenAI tool-call deltas."""
