"""SFT samples and preference pairs: targets cover exactly the response (every assistant turn of a chat), bad rows are
skipped with their line numbers or refused, chats go through the tokenizer's own template."""

import json
import logging
import os

import pytest

from aligner.config.reward_model import PreferenceDataConfig
from aligner.config.sft import SFTDataConfig
from aligner.data.rows import DataError
from aligner.data.supervised import PreferenceDataset, SFTDataset
from aligner.data.tokenizer import load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_TOKENIZER = os.path.join(REPO, "conf", "demo", "tokenizer.json")
TEMPLATE = (
    "{% for m in messages %}<bos>{{ m['role'][0] }}:{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<bos>a:{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEMO_TOKENIZER)


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    """The demo vocabulary as an HF tokenizer directory with a chat template (built here, nothing downloaded)."""
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("chat_tok")
    hf = PreTrainedTokenizerFast(
        tokenizer_file=DEMO_TOKENIZER, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    hf.chat_template = TEMPLATE
    hf.save_pretrained(str(path))
    return load_tokenizer(str(path))


def write(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def decode_targets(tok, sample):
    """The text of each run of target tokens."""
    runs, current = [], []
    for token, is_target in zip(sample.ids.tolist(), sample.targets.tolist()):
        if is_target:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(r) for r in runs], [r[-1] for r in runs]


def test_plain_sft_targets_are_exactly_the_response_and_eos(tmp_path, tok):
    ds = SFTDataset(write(tmp_path, [{"prompt": "say a:", "response": " cat."}]), tok, SFTDataConfig())
    s = ds[0]
    assert s.ids.tolist() == [tok.bos_id] + tok.encode("say a:") + tok.encode(" cat.") + [tok.eos_id]
    n_prompt = 1 + len(tok.encode("say a:"))
    assert s.targets.tolist() == [False] * n_prompt + [True] * (len(" cat.") + 1)


def test_chat_sft_targets_are_exactly_the_assistant_turns(tmp_path, chat_tok):
    messages = [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "done"},
    ]
    ds = SFTDataset(write(tmp_path, [{"messages": messages}]), chat_tok, SFTDataConfig())
    s = ds[0]
    assert chat_tok.decode(s.ids.tolist()) == "s:be niceu:hia:you:and?a:done"  # specials skipped when decoding
    texts, last = decode_targets(chat_tok, s)
    assert texts == ["yo", "done"]  # the assistant contents and their end-of-turn token, nothing else
    assert last == [chat_tok.eos_id, chat_tok.eos_id]
    assert int(s.targets.sum()) == len("yo") + len("done") + 2


def test_bad_rows_are_skipped_and_reported_by_line(tmp_path, tok, caplog):
    rows = [
        {"prompt": "a", "response": " b"},
        {"prompt": "a"},  # line 2: no response
        {"prompt": "a", "response": "   "},  # line 3: empty response
        {"prompt": "a", "response": "x" * 100},  # line 4: too long
        {"prompt": 7, "response": " b"},  # line 5: not a string
        {"prompt": "c", "response": " d"},
    ]
    path = write(tmp_path, rows)
    with caplog.at_level(logging.WARNING):
        ds = SFTDataset(path, tok, SFTDataConfig(max_length=32))
    assert len(ds) == 2
    (warning,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert "skipped 4 of 6 rows" in warning
    for line, why in ((2, "'response'"), (3, "empty 'response'"), (4, "more than data.max_length=32"), (5, "'prompt'")):
        assert f"{path}:{line} (" in warning and why in warning


def test_bad_rows_refused_name_file_and_line(tmp_path, tok):
    path = write(tmp_path, [{"prompt": "a", "response": " b"}, {"prompt": "a", "response": ""}])
    with pytest.raises(DataError, match=rf"^{path}:2: empty 'response'.*data.bad_rows=skip"):
        SFTDataset(path, tok, SFTDataConfig(bad_rows="error"))


def test_a_file_without_usable_rows_is_an_error(tmp_path, tok):
    path = write(tmp_path, [{"question": "a"}])
    with pytest.raises(DataError, match="no usable rows"):
        SFTDataset(path, tok, SFTDataConfig())


def test_chat_rows_need_a_template(tmp_path, tok):
    path = write(tmp_path, [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}])
    with pytest.raises(DataError, match="no chat template"):
        SFTDataset(path, tok, SFTDataConfig())


def test_plain_pairs_share_the_prompt(tmp_path, tok):
    path = write(tmp_path, [{"prompt": "say a:", "chosen": " aa", "rejected": " bbbb"}])
    (pair,) = PreferenceDataset(path, tok, PreferenceDataConfig()).pairs
    prompt = [tok.bos_id] + tok.encode("say a:")
    assert pair.prompt_length == len(prompt)
    assert pair.chosen.tolist() == prompt + tok.encode(" aa") + [tok.eos_id]
    assert pair.rejected.tolist() == prompt + tok.encode(" bbbb") + [tok.eos_id]
    assert len(pair) == len(pair.rejected)


def test_chat_pairs_render_the_reply_as_an_assistant_turn(tmp_path, chat_tok):
    row = {
        "messages": [{"role": "user", "content": "hi"}],
        "chosen": "aa",
        "rejected": {"role": "assistant", "content": "b"},
    }
    (pair,) = PreferenceDataset(write(tmp_path, [row]), chat_tok, PreferenceDataConfig()).pairs
    assert chat_tok.decode(pair.chosen[pair.prompt_length :].tolist()) == "aa"
    assert pair.chosen[-1] == chat_tok.eos_id
    assert chat_tok.decode(pair.rejected[pair.prompt_length :].tolist()) == "b"


def test_bad_pairs_are_reported(tmp_path, tok):
    path = write(tmp_path, [{"prompt": "a", "chosen": " b", "rejected": " c"}, {"prompt": "a", "chosen": " b"}])
    with pytest.raises(DataError, match=rf"^{path}:2: needs a string field 'rejected'"):
        PreferenceDataset(path, tok, PreferenceDataConfig(bad_rows="error"))
    assert len(PreferenceDataset(path, tok, PreferenceDataConfig())) == 1
