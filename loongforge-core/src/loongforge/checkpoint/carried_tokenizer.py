"""The tokenizer that travels with weights, so whatever reads them later decodes the ids they were trained on.

Why carry it rather than trust ``config.yaml``: the config names the tokenizer as the run named it (``byte``,
``hf:/some/dir``), and a path on the machine that trained is no promise on the machine that reads; a model's
vocabulary alone cannot tell two tokenizers apart either (the 259 byte ids fit any vocabulary of 259 or more). So every
directory LoongForge writes weights into also holds the tokenizer itself, as one of two things:

* a Hugging Face tokenizer: its files (:data:`TOKENIZER_FILES`, what ``save_pretrained`` writes), which transformers
  and :class:`~loongforge.data.tokenizers.HFTokenizer` both read;
* a tokenizer without files (the built-in ``byte``, a plugin's registered kind with its ``:argument``): the descriptor
  :data:`DESCRIPTOR`, ``{"tokenizer": "<the data.tokenizer value>"}``. Transformers ignores the file.

Where: beside ``config.json`` in a Hugging Face export (``checkpoint.save_hf``'s ``hf/``, ``convert mcore-to-hf``);
in ``tokenizer/`` (:data:`TOKENIZER_DIR`) of a training checkpoint; in ``hf_source/`` of a converted checkpoint,
with the source's ``config.json``. Torch-free.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from loongforge.errors import InteropError
from loongforge.hf_dirs import holds_hf_tokenizer

#: A Hugging Face tokenizer's files, as ``save_pretrained`` writes them (``tokenizer.json`` is the one we read).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
#: The descriptor of a tokenizer without files.
DESCRIPTOR = "loongforge_tokenizer.json"
#: The directory of a training checkpoint (``step-N/``) that holds its tokenizer.
TOKENIZER_DIR = "tokenizer"


def hf_tokenizer_dir(spec: str) -> Path | None:
    """The directory a ``data.tokenizer`` value reads a Hugging Face tokenizer from (``hf:DIR``, or a bare directory
    as :func:`~loongforge.data.tokenizers.load_tokenizer` accepts it); ``None`` for a registered kind."""
    if spec.startswith("hf:"):
        return Path(spec[3:]).expanduser()
    path = Path(spec).expanduser()
    return path if ":" not in spec and holds_hf_tokenizer(path) else None



def write_tokenizer(spec: str, target: Path) -> list[str]:
    """Carry the tokenizer ``spec`` (a ``data.tokenizer`` value) into the existing directory ``target``: copy a Hugging
    Face tokenizer's files, else write the descriptor. Returns the names written."""
    source = hf_tokenizer_dir(spec)
    if source is None:
        (target / DESCRIPTOR).write_text(json.dumps({"tokenizer": spec}, indent=1) + "\n", encoding="utf-8")
        return [DESCRIPTOR]
    if not holds_hf_tokenizer(source):
        raise InteropError(f"tokenizer {spec}: neither {source / 'tokenizer.json'} nor tokenizer.model found; it "
                           "cannot be carried")
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copy2(source / name, target / name)
    return copied


def carried_tokenizer(directory: Path) -> str | None:
    """The tokenizer ``directory`` carries, spelt as ``data.tokenizer`` spells it: ``hf:<directory>`` when it holds
    ``tokenizer.json`` (or a SentencePiece ``tokenizer.model``), the descriptor's spec when it holds :data:`DESCRIPTOR`,
    else ``None``."""
    if holds_hf_tokenizer(directory):
        return f"hf:{directory}"
    path = directory / DESCRIPTOR
    if not path.is_file():
        return None
    try:
        spec = json.loads(path.read_text(encoding="utf-8")).get("tokenizer")
    except (OSError, ValueError, AttributeError) as exc:
        raise InteropError(f"{path}: not a tokenizer descriptor ({exc})") from None
    if not isinstance(spec, str) or not spec:
        raise InteropError(f"{path}: not a tokenizer descriptor (needs {{\"tokenizer\": \"<kind>\"}})")
    return spec


def carry_run_tokenizer(config_yaml: str, checkpoint: Path) -> list[str]:
    """Carry the tokenizer a run's resolved config (``config_yaml``, as saved beside the weights) names into
    ``checkpoint/tokenizer/``; nothing for a config without ``data.tokenizer`` (a task model trains on no tokens)."""
    spec = ((yaml.safe_load(config_yaml) or {}).get("data") or {}).get("tokenizer")
    if not spec:
        return []
    (checkpoint / TOKENIZER_DIR).mkdir(exist_ok=True)
    return write_tokenizer(spec, checkpoint / TOKENIZER_DIR)


def agrees(carried: str, recorded: str) -> bool:
    """Whether a carried tokenizer is the one a config records: both Hugging Face tokenizers (the recorded path may
    have moved since; the carried files are the copy), or the same registered kind and argument."""
    carried_hf, recorded_hf = hf_tokenizer_dir(carried) is not None, hf_tokenizer_dir(recorded) is not None
    return (carried_hf and recorded_hf) or (not carried_hf and not recorded_hf and carried == recorded)
