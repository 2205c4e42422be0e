"""Constrained decoding (xgrammar): grammars compiled off the scheduler's critical path
(`backend.py`), one matcher per request (`matcher.py`), the batch's token bitmask
(`vocab_mask.py`), jump-forward over forced text (`jump_forward.py`), and the syntax check the
front ends run before a request is sent (`validation.py`).

xgrammar is imported only by these modules, and only when a request asks for a grammar.
"""
