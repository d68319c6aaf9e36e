"""Prompt datasets: the three file formats give the same rows; plain prompts are tokenised as the HF tokenizer does
(its post-processor decides BOS), chats as its chat template does; long prompts are skipped, truncated or refused;
every bad file or row is a DataError naming the place."""

import logging
import os
import re
import sys

import pytest
from tiny_assets import BOS, word_tokenizer, write_jsonl

from aligner.data.prompts import PromptDataset, render_prompt
from aligner.data.rows import DataError, Row, read_rows
from aligner.data.tokenizer import load_tokenizer

CHAT = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w7 w8"}]
ROWS = [
    {"prompt": "w7 w8 w9", "label": "a"},
    {"messages": CHAT, "label": "b"},
    {"prompt": "w10"},
]


@pytest.fixture(scope="module")
def hf_tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    word_tokenizer(bos=True, chat=True).save_pretrained(d)
    return str(d)


def _columns(rows) -> dict:
    """Column-wise, with every key of every row (from_pylist/from_list would take the first row's keys only)."""
    keys = dict.fromkeys(k for r in rows for k in r)
    return {k: [r.get(k) for r in rows] for k in keys}


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(_columns(rows)), path, row_group_size=2)  # several row groups, read in order
    return str(path)


def _saved_dataset(path, rows, shards=2):
    import datasets

    datasets.Dataset.from_dict(_columns(rows)).save_to_disk(str(path), num_shards=shards)
    return str(path)


def test_jsonl_parquet_and_saved_dataset_give_the_same_rows(tmp_path):
    rows = [dict(r, n=i) for i, r in enumerate(ROWS)]
    jsonl = write_jsonl(tmp_path / "p.jsonl", rows)
    parquet = _parquet(tmp_path / "p.data", rows)  # recognised by its magic bytes, not the extension
    saved = _saved_dataset(tmp_path / "ds", rows)

    def norm(data):  # Arrow fills a column missing from a row with None
        return {k: v for k, v in data.items() if v is not None}

    got = {path: list(read_rows(path)) for path in (jsonl, parquet, saved)}
    for path, read in got.items():
        assert [norm(r.data) for r in read] == rows, path
    assert [r.where for r in got[jsonl]] == [f"{jsonl}:{i}" for i in (1, 2, 3)]
    assert [r.where for r in got[parquet]] == [f"{parquet} row {i}" for i in (0, 1, 2)]
    assert [r.where for r in got[saved]] == [f"{saved} row {i}" for i in (0, 1, 2)]


def test_a_shuffled_saved_dataset_is_read_in_its_saved_order(tmp_path):
    import datasets

    rows = [{"prompt": f"w{i}"} for i in range(6, 30)]
    ds = datasets.Dataset.from_list(rows).shuffle(seed=0)
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=3)
    assert [r.data["prompt"] for r in read_rows(str(tmp_path / "ds"))] == ds["prompt"]


def test_bad_files_are_data_errors_naming_the_place(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "w7"}\n\n[1, 2]\n')
    with pytest.raises(DataError, match=rf"^{bad}:3: a JSON list, not an object"):
        list(read_rows(str(bad)))
    bad.write_text('{"prompt": "w7"}\n{"prompt": \n')
    with pytest.raises(DataError, match=rf"^{bad}:2: not valid JSON"):
        list(read_rows(str(bad)))
    with pytest.raises(DataError, match="no such file"):
        list(read_rows(str(tmp_path / "missing.jsonl")))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="without state.json"):
        list(read_rows(str(tmp_path / "empty_dir")))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(DataError, match=rf"^{broken}: cannot be read as Parquet"):
        list(read_rows(str(broken)))


def test_a_dataset_dict_directory_names_its_splits(tmp_path):
    import datasets

    split = datasets.Dataset.from_list([{"prompt": "w7"}])
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"DatasetDict with splits \['test', 'train'\]: give one split's directory"):
        list(read_rows(str(tmp_path / "dd")))
    assert [r.data for r in read_rows(str(tmp_path / "dd" / "train"))] == [{"prompt": "w7"}]


def test_without_pyarrow_the_error_names_the_package(tmp_path, monkeypatch):
    path = _parquet(tmp_path / "p.parquet", ROWS[:1])
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` now raises ImportError
    with pytest.raises(DataError, match=r"needs the `pyarrow` package: pip install pyarrow"):
        list(read_rows(path))
    write_jsonl(tmp_path / "p.jsonl", ROWS)  # JSONL needs nothing beyond the standard library
    assert len(list(read_rows(str(tmp_path / "p.jsonl")))) == 3


@pytest.mark.parametrize("bos", [True, False])
def test_plain_prompts_are_tokenised_exactly_as_the_hf_tokenizer_does(tmp_path, bos):
    d = tmp_path / "tok"
    hf = word_tokenizer(bos=bos, chat=False)
    hf.save_pretrained(d)
    tok = load_tokenizer(str(d))
    for text in ("w7 w8 w9", "w42 w7", ""):
        assert tok.encode_prompt(text) == hf(text)["input_ids"]
    assert render_prompt(Row("x", {"prompt": "w7 w8 w9"}), tok) == ("w7 w8 w9", hf("w7 w8 w9")["input_ids"])
    if bos:
        assert render_prompt(Row("x", {"prompt": ""}), tok)[1] == [BOS]
    else:
        with pytest.raises(DataError, match="^x: the prompt tokenises to nothing"):
            render_prompt(Row("x", {"prompt": ""}), tok)
    assert tok.encode_prompt("w7")[0] == (BOS if bos else 7), "BOS comes from the post-processor, once or never"
    # a bare tokenizer.json behaves as the same tokenizer loaded by transformers
    hf.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(str(tmp_path / "tokenizer.json")).encode_prompt("w7 w8") == hf("w7 w8")["input_ids"]


def test_chat_rows_are_rendered_with_the_chat_template_and_a_generation_prompt(hf_tok_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(hf_tok_dir)
    tok = load_tokenizer(hf_tok_dir)
    text, ids = render_prompt(Row("x", {"messages": CHAT}), tok)
    assert ids == hf.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    assert text == hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert ids[0] == BOS and ids[1] != BOS, "the template writes BOS; nothing adds a second one"
    assert text.endswith("<|assistant|>")


def test_dataset_keys_labels_and_places(tmp_path, hf_tok_dir):
    tok = load_tokenizer(hf_tok_dir)
    rows = [{"q": "w7 w8", "chat": None, "y": "yes"}, {"chat": CHAT, "y": [1, 2]}, {"q": "w9"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    data = PromptDataset(path, tok, 16, prompt_key="q", messages_key="chat", label_key="y")
    assert [p.ids for p in data.items] == [
        tok.encode_prompt("w7 w8"),
        tok.apply_chat_template(CHAT),
        tok.encode_prompt("w9"),
    ]
    assert [p.label for p in data.items] == ["yes", "[1, 2]", None]
    assert [p.where for p in data.items] == [f"{path}:{i}" for i in (1, 2, 3)]
    assert data.items[0].text == "w7 w8"


@pytest.mark.parametrize(
    "row, message",
    [
        (
            {"text": "w7"},
            "needs a string 'prompt' (data.prompt_key) or a list 'messages' (data.messages_key); 'prompt' is missing",
        ),
        ({"prompt": 7}, "'prompt' is of type int"),
        ({"prompt": "w7", "messages": CHAT}, "has both 'prompt' and 'messages': give one"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"messages": [{"content": "w7"}]}, "messages[0] must be an object with a string 'role'"),
        ({"messages": "w7"}, "'messages' must be a non-empty list"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, hf_tok_dir, row, message):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "w7"}, row])
    with pytest.raises(DataError, match="^" + re.escape(f"{path}:2: ") + ".*" + re.escape(message)):
        PromptDataset(path, load_tokenizer(hf_tok_dir), 16)


def test_a_chat_row_needs_a_chat_template(tmp_path):
    d = tmp_path / "tok"
    word_tokenizer(chat=False).save_pretrained(d)
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": CHAT}])
    with pytest.raises(DataError, match=rf"^{path}:1: a chat row .* has no chat template"):
        PromptDataset(path, load_tokenizer(str(d)), 16)


def test_a_template_that_refuses_the_messages_names_the_row(tmp_path):
    d = tmp_path / "tok"
    hf = word_tokenizer()
    hf.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('start with a user turn') }}{% endif %}"
    )
    hf.save_pretrained(d)
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": CHAT}])
    with pytest.raises(DataError, match=rf"^{path}:1: the chat template refused these messages: start with a user"):
        PromptDataset(path, load_tokenizer(str(d)), 16)


def test_long_prompts_are_skipped_truncated_or_refused(tmp_path, hf_tok_dir, caplog):
    tok = load_tokenizer(hf_tok_dir)
    long = " ".join(f"w{i}" for i in range(10, 20))  # 11 tokens with BOS
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "w7"}, {"prompt": long}, {"prompt": long}])
    with caplog.at_level(logging.WARNING):
        skipped = PromptDataset(path, tok, 5)
    assert [p.ids for p in skipped.items] == [[BOS, 7]] and skipped.skipped == 2
    assert "skipped 2 of 3 prompts longer than 5 tokens" in caplog.text and f"{path}:2" in caplog.text
    cut = PromptDataset(path, tok, 5, long_prompts="truncate_left")
    assert [p.ids for p in cut.items] == [[BOS, 7], [15, 16, 17, 18, 19], [15, 16, 17, 18, 19]]
    assert cut.truncated == 2 and cut.skipped == 0
    with pytest.raises(DataError, match=rf"^{path}:2: the prompt has 11 tokens, more than 5"):
        PromptDataset(path, tok, 5, long_prompts="error")
    only_long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": long}])
    with pytest.raises(DataError, match=r"no usable prompts \(1 rows, 1 longer than 5 tokens\)"):
        PromptDataset(only_long, tok, 5)


def test_actor_config_data_keys():
    from aligner.config import ConfigError
    from aligner.config.actor import ActorJobConfig
    from aligner.config.loader import load_config

    cfg = load_config(ActorJobConfig, "ppo_actor_demo", ["data.long_prompts=truncate_left"])
    assert (cfg.data.prompt_key, cfg.data.messages_key, cfg.data.long_prompts) == (
        "prompt",
        "messages",
        "truncate_left",
    )
    with pytest.raises(ConfigError, match="data.long_prompts"):
        load_config(ActorJobConfig, "ppo_actor_demo", ["data.long_prompts=cut"])
    with pytest.raises(ConfigError, match="data.messages_key.*must differ from data.prompt_key"):
        load_config(ActorJobConfig, "ppo_actor_demo", ["data.messages_key=prompt"])
    with pytest.raises(ConfigError, match="data.add_bos"):  # gone: the tokenizer decides BOS
        load_config(ActorJobConfig, "ppo_actor_demo", ["data.add_bos=true"])


def test_demo_prompts_start_with_the_tokenizers_bos():
    """The demo tokenizer's post-processor adds <bos> (the jobs add nothing), so the CPU demo sees what it did."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tok = load_tokenizer(os.path.join(root, "conf", "demo", "tokenizer.json"))
    data = PromptDataset(os.path.join(root, "conf", "demo", "prompts_train.jsonl"), tok, 32)
    assert len(data) == 256 and all(p.ids[0] == tok.bos_id and p.ids[1] != tok.bos_id for p in data.items)
    assert tok.decode(data.items[0].ids) == data.items[0].text
