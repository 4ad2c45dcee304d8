"""``data.txt_split`` decides what a document of a ``.txt`` input is, in the dataset a run opens.

The run opens ``data.dataset: text`` through :func:`loongforge.train.batches.open_dataset` (what ``train`` and
``check`` call): three paragraphs of two lines each are 3 documents with ``paragraph``, 6 with ``line`` and 1 with
``file``, and every document ends with the tokenizer's end-of-text id.
"""

from __future__ import annotations

import pytest
from loongforge.config import load_config
from loongforge.plugins import get_host
from loongforge.train.batches import load_tokenizer, open_dataset

TEXT = "first line\nsecond line\n\n\nthird line\nfourth line\n   \nfifth line\nsixth line\n"


@pytest.mark.parametrize("rule,documents", [("paragraph", 3), ("line", 6), ("file", 1)])
def test_txt_split_rule_reaches_the_dataset(tmp_path, rule, documents):
    source = tmp_path / "book.txt"
    source.write_text(TEXT)
    config = load_config(None, ["data.dataset=text", f"data.paths=[{source}]", f"data.txt_split={rule}",
                                f"run.output_dir={tmp_path / rule}"])
    host = get_host()
    tokenizer = load_tokenizer(host, config)
    dataset = open_dataset(host, config, tokenizer)
    assert dataset.num_documents == documents
    eos_positions = [i for i, t in enumerate(dataset.tokens.tolist()) if t == tokenizer.eos_id]
    assert len(eos_positions) == documents and eos_positions[-1] == len(dataset.tokens) - 1


def test_unknown_rule_is_a_config_error(tmp_path):
    from loongforge.errors import ConfigError

    with pytest.raises(ConfigError, match="data.txt_split"):
        load_config(None, ["data.txt_split=sentence"])
