"""Models the stack makes itself: random weights at a real architecture, nothing downloaded.

`invoke make-model tiny` writes a small Qwen3 (`tiny.py`) with a BPE tokenizer carrying Qwen's
special tokens and a chat template that handles thinking and tools (`chat_template.py`), so a
real vLLM engine can boot and answer on a machine without a GPU or network (the `tiny` profile).
It reuses `workload`'s corpus tokenizer, and sits below `bench` and `serve`.
"""
