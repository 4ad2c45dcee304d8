"""Core's dataset kinds and tokenizers, registered by name through the plugin hooks.

Torch-free and import-free: targets are ``"module:attr"`` strings, imported only when a run uses them.
Dataset targets are factories with the signature documented in :mod:`loongforge.data.kinds`; tokenizer
targets are classes (``byte`` takes no argument, ``hf`` takes the local directory).
"""

from __future__ import annotations

from typing import Any


def register_builtin_datasets(registry: Any) -> None:
    registry.register(
        "mmap",
        "loongforge.data.kinds:mmap_dataset",
        aliases=("indexed", "megatron"),
        description="Megatron-LM indexed dataset (PREFIX.bin + PREFIX.idx) from `loongforge preprocess` or Megatron-LM",
    )
    registry.register(
        "text",
        "loongforge.data.kinds:text_dataset",
        aliases=("jsonl", "txt"),
        description="raw .txt (a document per paragraph) / .jsonl files, tokenized on first use and cached",
    )
    registry.register(
        "hf-datasets",
        "loongforge.data.hf_datasets:hf_dataset",
        aliases=("parquet", "arrow"),
        description="local Hugging Face datasets (parquet/arrow/jsonl, save_to_disk folders), streamed and cached",
    )
    registry.register(
        "shipped-corpus",
        "loongforge.data.kinds:shipped_corpus",
        aliases=("austen",),
        description="three Jane Austen novels (1.8 MB, public domain) shipped with loongforge-core",
    )
    registry.register(
        "sft",
        "loongforge.data.chat_dataset:sft_dataset",
        aliases=("chat",),
        description="chat .jsonl (OpenAI messages or ShareGPT conversations, tool calls too) for training.phase sft;"
                    " loss on assistant turns",
    )
    registry.register(
        "shipped-chat",
        "loongforge.data.chat_dataset:shipped_chat",
        description="small generated chat set (arithmetic, Austen facts) shipped with loongforge-core",
    )
    registry.register(
        "preference",
        "loongforge.data.preference_dataset:preference_dataset",
        aliases=("dpo",),
        description="preference .jsonl ({prompt, chosen, rejected}: strings or chat messages) for training.phase dpo",
    )
    registry.register(
        "shipped-preference",
        "loongforge.data.preference_dataset:shipped_preference",
        description="small generated preference pairs (right vs wrong answers) shipped with loongforge-core",
    )
    registry.register(
        "prompts",
        "loongforge.data.prompt_dataset:prompt_dataset",
        aliases=("grpo",),
        description="prompt .jsonl ({prompt, answer, reward}: a string or chat messages, the answer a reward checks)"
                    " for training.phase grpo",
    )
    registry.register(
        "shipped-tasks",
        "loongforge.data.prompt_dataset:shipped_tasks",
        description="small generated verifiable tasks (sums, capitals, backwards spelling) shipped with "
                    "loongforge-core",
    )


def register_builtin_tokenizers(registry: Any) -> None:
    registry.register(
        "byte",
        "loongforge.data.tokenizers:ByteTokenizer",
        description="built-in UTF-8 byte-level tokenizer (259 ids), no files needed",
    )
    registry.register(
        "hf",
        "loongforge.data.tokenizers:HFTokenizer",
        aliases=("huggingface",),
        description="Hugging Face fast tokenizer from a local directory (hf:/path/to/dir); needs [hf] extra",
    )
