"""Section 3 (Data): record formats -> canonical records, file:line errors, the LLaMA-Factory and demo
registries, chat templates and loss masks, truncation, the tokenisation cache, packing (checked against
a real tiny Llama), the collator, streaming (order, resume, sharding) and answer extraction."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import rlhf_log

import rlhf
from rlhf import IGNORE_INDEX, ChatFormatter, RLHFInputError

SFT_KEYS = {"system", "messages", "location", "response"}
PREFERENCE_KEYS = {"system", "messages", "location", "chosen", "rejected"}
KTO_KEYS = {"system", "messages", "location", "response", "label"}
PROMPT_KEYS = {"system", "messages", "location", "answer", "verifiable"}


# ---------------------------------------------------------------- helpers


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_json(path: Path, data, indent: int | None = None) -> Path:
    path.write_text(json.dumps(data, indent=indent), encoding="utf-8")
    return path


def write_text(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def load(path: Path, kind: str, **kwargs) -> list[dict]:
    return rlhf.load_records(str(path), path.parent, kind, **kwargs)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def strip_location(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "location"} for r in records]




def record(prompt: str, response: str, system: str = "", history: list[dict] | None = None) -> dict:
    return {"system": system, "messages": [*(history or []), user(prompt)], "response": response}


# ---------------------------------------------------------------- record formats


def test_canonical_sft_jsonl(tmp_path):
    path = write_text(tmp_path / "sft.jsonl", '{"prompt": "What is 1 + 2?", "response": "3"}\n\n'
                                              '{"prompt": "Hi", "response": "Hello", "system": "Be brief."}\n')
    records = load(path, "sft")
    assert [set(r) for r in records] == [SFT_KEYS, SFT_KEYS]
    assert records[0] == {"system": "", "messages": [user("What is 1 + 2?")], "response": "3",
                          "location": f"{path}:1"}
    assert records[1]["system"] == "Be brief." and records[1]["location"] == f"{path}:3"  # blank lines count


def test_canonical_preference(tmp_path):
    path = write_jsonl(tmp_path / "pref.jsonl", [{"prompt": "p", "chosen": "good", "rejected": "bad"}])
    (rec,) = load(path, "preference")
    assert set(rec) == PREFERENCE_KEYS
    assert (rec["messages"], rec["chosen"], rec["rejected"]) == ([user("p")], "good", "bad")


def test_canonical_kto_labels(tmp_path):
    labels = [True, False, "desirable", "undesirable", "true", "false", 1, 0]
    path = write_jsonl(tmp_path / "kto.jsonl", [{"prompt": f"p{i}", "response": f"r{i}", "label": v}
                                                for i, v in enumerate(labels)])
    records = load(path, "kto")
    assert all(set(r) == KTO_KEYS for r in records)
    assert [r["label"] for r in records] == [True, False, True, False, True, False, True, False]
    assert all(isinstance(r["label"], bool) for r in records)


def test_kto_bad_label(tmp_path):
    path = write_jsonl(tmp_path / "kto.jsonl", [{"prompt": "p", "response": "r", "label": True},
                                                {"prompt": "p", "response": "r", "label": "maybe"}])
    with pytest.raises(RLHFInputError, match=rf"^{path}:2: field 'label' must be true/false"):
        load(path, "kto")


def test_kto_without_label(tmp_path):
    path = write_jsonl(tmp_path / "kto.jsonl", [{"prompt": "p", "response": "r"}])
    with pytest.raises(RLHFInputError, match=rf"^{path}:1: record has no 'label'"):
        load(path, "kto")


def test_prompt_only_list_of_strings(tmp_path):
    path = write_json(tmp_path / "prompts.json", ["What is 2 + 2?", "What is 3 + 3?"], indent=2)
    records = load(path, "prompt")
    assert all(set(r) == PROMPT_KEYS for r in records)
    assert [r["messages"] for r in records] == [[user("What is 2 + 2?")], [user("What is 3 + 3?")]]
    assert [r["location"] for r in records] == [f"{path}:2", f"{path}:3"]
    assert all(r["answer"] is None and r["verifiable"] is False for r in records)


def test_prompt_only_objects(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "a"},
        {"prompt": "b", "answer": "4"},
        {"prompt": "c", "answer": 7, "verifiable": True},
        {"prompt": "d", "answer": "x", "verifiable": False},
    ])
    records = load(path, "prompt")
    assert [(r["answer"], r["verifiable"]) for r in records] == [(None, False), ("4", True), ("7", True),
                                                                 ("x", False)]


def test_alpaca(tmp_path):
    path = write_json(tmp_path / "alpaca.json", [
        {"instruction": "Translate", "input": "bonjour", "output": "hello", "system": "You translate.",
         "history": [["q1", "a1"], ["q2", "a2"]]},
        {"instruction": "Say hi", "input": "", "output": "hi"},
    ], indent=1)
    first, second = load(path, "sft")
    assert first["system"] == "You translate."
    assert first["messages"] == [user("q1"), assistant("a1"), user("q2"), assistant("a2"), user("Translate\nbonjour")]
    assert first["response"] == "hello"
    assert second == {"system": "", "messages": [user("Say hi")], "response": "hi", "location": second["location"]}


def test_alpaca_bad_history(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "i", "output": "o", "history": [["only one"]]}])
    with pytest.raises(RLHFInputError, match=rf"^{path}:1: field 'history'"):
        load(path, "sft")


def test_sharegpt(tmp_path):
    path = write_jsonl(tmp_path / "sg.jsonl", [
        {"conversations": [{"from": "system", "value": "Sys"}, {"from": "human", "value": "h1"},
                           {"from": "gpt", "value": "g1"}, {"from": "human", "value": "h2"},
                           {"from": "gpt", "value": "g2"}]},
        {"conversations": [{"from": "human", "value": "h"}, {"from": "gpt", "value": "g"}], "system": "col"},
    ])
    first, second = load(path, "sft")
    assert first["system"] == "Sys"
    assert first["messages"] == [user("h1"), assistant("g1"), user("h2")]
    assert first["response"] == "g2"
    assert (second["system"], second["messages"], second["response"]) == ("col", [user("h")], "g")


OPENAI_ROWS = [{"messages": [{"role": "system", "content": "S"}, user("u1"), assistant("a1"), user("u2"),
                             assistant("a2")]}]


def test_openai_messages_registered(tmp_path):
    write_jsonl(tmp_path / "chat.jsonl", OPENAI_ROWS)
    write_json(tmp_path / "dataset_info.json", {"chat": {
        "file_name": "chat.jsonl", "formatting": "sharegpt", "columns": {"messages": "messages"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}})
    (rec,) = rlhf.load_records("chat", tmp_path, "sft")
    assert rec["system"] == "S"
    assert rec["messages"] == [user("u1"), assistant("a1"), user("u2")] and rec["response"] == "a2"


def test_openai_messages_unregistered(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", OPENAI_ROWS)
    (rec,) = load(path, "sft")
    assert rec["messages"] == [user("u1"), assistant("a1"), user("u2")] and rec["response"] == "a2"


def test_trl_conversational_prompt_lists(tmp_path):
    path = write_jsonl(tmp_path / "trl.jsonl", [
        {"prompt": [{"role": "system", "content": "S"}, user("q")],
         "chosen": [assistant("yes")], "rejected": [assistant("no")]},
        {"prompt": [user("q1"), assistant("a1"), user("q2")], "chosen": [assistant("c")], "rejected": [assistant("r")]},
    ])
    first, second = load(path, "preference")
    assert (first["system"], first["messages"], first["chosen"], first["rejected"]) == ("S", [user("q")], "yes", "no")
    assert second["messages"] == [user("q1"), assistant("a1"), user("q2")]
    sft = write_jsonl(tmp_path / "trl_sft.jsonl", [{"prompt": [user("q")], "response": [assistant("a")]}])
    assert load(sft, "sft")[0]["response"] == "a"


def test_trl_prompt_completion(tmp_path):
    path = write_jsonl(tmp_path / "trl.jsonl", [{"prompt": [user("q")], "completion": [assistant("a")]}])
    assert load(path, "sft")[0]["response"] == "a"


def test_document_target(tmp_path):
    path = write_jsonl(tmp_path / "rl_train.jsonl", [{"document": "text to fine-tune on", "target": "expected output"}])
    (rec,) = load(path, "sft")
    assert rec["messages"] == [user("text to fine-tune on")] and rec["response"] == "expected output"


ROWS = [{"prompt": f"What is {i} + 1?", "response": f"{i} + 1 = {i + 1}\nAnswer: {i + 1}"} for i in range(5)]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_byte_order_mark_is_accepted(tmp_path, suffix):
    rows = [{"prompt": "What is 1 + 2?", "response": "3"}, {"prompt": "What is 2 + 2?", "response": "4"}]
    text = "".join(json.dumps(r) + "\n" for r in rows) if suffix == ".jsonl" else json.dumps(rows, indent=1)
    path = tmp_path / f"bom{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    assert [r["response"] for r in load(path, "sft")] == ["3", "4"]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_non_utf8_byte_names_its_line(tmp_path, suffix):
    rows = [{"prompt": "What is 1 + 2?", "response": "3"}, {"prompt": "caf\u00e9?", "response": "ok"}]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) if suffix == ".jsonl" else \
        json.dumps(rows, indent=1, ensure_ascii=False)
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes(text.encode("latin-1"))
    line = 2 if suffix == ".jsonl" else 7  # json.dumps(indent=1) puts the second record's prompt on line 7
    with pytest.raises(rlhf.RLHFInputError, match=rf"latin1{suffix}:{line}: not UTF-8 text \(byte 0xe9\)"):
        load(path, "sft")


def test_json_jsonl_parquet_and_hf_directory_agree(tmp_path):
    from datasets import Dataset

    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS)
    array = write_json(tmp_path / "d.json", ROWS, indent=2)
    parquet = tmp_path / "d.parquet"
    Dataset.from_list(ROWS).to_parquet(str(parquet))
    hf_dir = tmp_path / "hf"
    Dataset.from_list(ROWS).save_to_disk(str(hf_dir))
    results = {name: load(path, "sft") for name, path in
               [("jsonl", jsonl), ("json", array), ("parquet", parquet), ("hf", hf_dir)]}
    expected = strip_location(results["jsonl"])
    assert len(expected) == 5
    for name, records in results.items():
        assert strip_location(records) == expected, name
        assert all(set(r) == SFT_KEYS for r in records)
    assert [r["location"] for r in results["json"]] == [f"{array}:{2 + 4 * i}" for i in range(5)]
    assert results["parquet"][1]["location"] == f"{parquet}:row 2"
    assert results["hf"][4]["location"] == f"{hf_dir}:row 5"


def test_csv_cells_are_text_and_records_carry_their_line(tmp_path):
    """CSV has no types: a response '2' is the text '2' (a type-guessing reader made it an int, which the
    record check refused), and booleans, margins and labels are parsed from their text."""
    sft = write_text(tmp_path / "sft.csv", 'prompt,response\nWhat is 1+1?,2\n\n"Say ""hi""\nplease",hi\n')
    records = load(sft, "sft")
    assert [r["response"] for r in records] == ["2", "hi"]
    assert [r["messages"][-1]["content"] for r in records] == ["What is 1+1?", 'Say "hi"\nplease']
    assert [r["location"] for r in records] == [f"{sft}:2", f"{sft}:4"]
    pairs = write_text(tmp_path / "pairs.csv", "prompt,chosen,rejected,margin\nq,1,2,0.5\nr,3,4,\n")
    assert [(r["chosen"], r.get("margin")) for r in load(pairs, "preference")] == [("1", 0.5), ("3", None)]
    kto = write_text(tmp_path / "kto.csv", "prompt,response,label\nq,a,true\nr,b,0\n")
    assert [r["label"] for r in load(kto, "kto")] == [True, False]
    prompts = write_text(tmp_path / "rl.csv", "prompt,answer,verifiable\nq,7,false\nr,8,\n")
    assert [(r["answer"], r["verifiable"]) for r in load(prompts, "prompt")] == [("7", False), ("8", True)]
    bad = write_text(tmp_path / "bad.csv", "prompt,response\nq,a,extra\n")
    assert single_line_error(lambda: load(bad, "sft")) == f"{bad}:2: 3 cells but the header has 2 columns"
    margin = write_text(tmp_path / "margin.csv", "prompt,chosen,rejected,margin\nq,a,b,big\n")
    assert "field 'margin' must be a number" in single_line_error(lambda: load(margin, "preference"))


def test_hf_directory_by_registered_name(tmp_path):
    from datasets import Dataset

    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert len(rlhf.load_records("saved", tmp_path, "sft")) == 5


def test_hf_dataset_dict_directory(tmp_path):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    assert len(load(tmp_path / "dd", "sft")) == 5


def test_directory_of_files(tmp_path):
    folder = tmp_path / "many"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", ROWS[:2])
    write_jsonl(folder / "b.jsonl", ROWS[2:])
    write_text(folder / "notes.txt", "ignored")
    assert strip_location(load(folder, "sft")) == strip_location(load(write_jsonl(tmp_path / "all.jsonl", ROWS), "sft"))


def test_max_samples_and_comma_separated(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ROWS)
    write_json(tmp_path / "b.json", [{"instruction": f"i{i}", "output": f"o{i}"} for i in range(4)])
    both = rlhf.load_records("a.jsonl, b.json", tmp_path, "sft")
    assert [r["response"] for r in both] == [r["response"] for r in ROWS] + ["o0", "o1", "o2", "o3"]
    capped = rlhf.load_records("a.jsonl,b.json", tmp_path, "sft", max_samples=2)  # per dataset
    assert [r["messages"][-1]["content"] for r in capped] == ["What is 0 + 1?", "What is 1 + 1?", "i0", "i1"]
    assert len(rlhf.load_records("a.jsonl", tmp_path, "sft", max_samples=100)) == 5


def test_registered_columns(tmp_path):
    write_jsonl(tmp_path / "qa.jsonl", [{"q": "question", "a": "answer", "ctx": "more"}])
    write_json(tmp_path / "dataset_info.json", {"qa": {"file_name": "qa.jsonl",
                                                       "columns": {"prompt": "q", "query": "ctx", "response": "a"}}})
    (rec,) = rlhf.load_records("qa", tmp_path, "sft")
    assert rec["messages"] == [user("question\nmore")] and rec["response"] == "answer"


# ---------------------------------------------------------------- registries

LLAMAFACTORY_EXPECTED = {"identity": ("sft", 91), "alpaca_en_demo": ("sft", 999),
                         "dpo_en_demo": ("preference", 300), "kto_en_demo": ("kto", 300),
                         "mllm_demo": ("sft", 6), "mllm_dpo_demo": ("preference", 24)}  # with images (test_vision.py)


@pytest.fixture(scope="module")
def llamafactory_dir(repo) -> Path:
    return repo / "data"  # bundled copies of LLaMA-Factory's demo files, in LLaMA-Factory's data/ layout


def test_every_llamafactory_file_is_covered(llamafactory_dir):
    info = json.loads((llamafactory_dir / "dataset_info.json").read_text(encoding="utf-8"))
    present = {name for name, entry in info.items()
               if "file_name" in entry and (llamafactory_dir / entry["file_name"]).exists()}
    assert present == set(LLAMAFACTORY_EXPECTED)


@pytest.mark.parametrize("name", sorted(LLAMAFACTORY_EXPECTED))
def test_llamafactory_datasets(llamafactory_dir, name):
    kind, count = LLAMAFACTORY_EXPECTED[name]
    records = rlhf.load_records(name, llamafactory_dir, kind)
    assert len(records) == count
    keys = {"sft": SFT_KEYS, "preference": PREFERENCE_KEYS, "kto": KTO_KEYS}[kind] | (
        {"images"} if name.startswith("mllm") else set())
    assert all(set(r) == keys for r in records)
    assert all(r["messages"] and r["messages"][-1]["role"] == "user" for r in records)
    assert all(m["role"] == ("user" if i % 2 == 0 else "assistant") for r in records
               for i, m in enumerate(r["messages"]))
    if kind == "preference":
        assert all(r["chosen"].strip() and r["rejected"].strip() for r in records)
    if kind == "kto":
        assert {r["label"] for r in records} == {True, False}
    if name == "identity":
        assert records[0]["messages"] == [user("hi")]
        assert records[0]["response"].startswith("Hello! I am {{name}}")
    assert records[0]["location"] == f"{llamafactory_dir / (name + '.json')}:2"


DEMO_EXPECTED = {"demo_sft": ("sft", 3000), "demo_preference": ("preference", 1500),
                 "demo_rm": ("preference", 12000), "demo_kto": ("kto", 1500),
                 "demo_sft_careless": ("sft", 3000), "demo_preference_careless": ("preference", 1500),
                 "demo_rm_careless": ("preference", 12000),
                 "demo_rl": ("prompt", 800), "demo_eval": ("prompt", 300), "demo_multistep": ("prompt", 200),
                 "demo_tool_sft": ("sft", 1000), "demo_tool_rl": ("prompt", 800),
                 "demo_tool_multistep": ("prompt", 200)}


def test_demo_registry_is_covered(repo):
    assert set(json.loads((repo / "data" / "demo" / "dataset_info.json").read_text())) == set(DEMO_EXPECTED)


@pytest.mark.parametrize("name", sorted(DEMO_EXPECTED))
def test_demo_registry(repo, name):
    kind, count = DEMO_EXPECTED[name]
    records = rlhf.load_records(name, repo / "data" / "demo", kind)
    assert len(records) == count
    if kind == "prompt":
        assert all(r["answer"] is not None and r["answer"].lstrip("-").isdigit() for r in records)
        assert all(r["verifiable"] is True for r in records)
    if kind == "kto":
        assert {r["label"] for r in records} == {True, False}
    if kind == "preference":
        assert all(r["chosen"] != r["rejected"] for r in records)
    assert all(r["messages"] == [user(r["messages"][0]["content"])] for r in records)


# ---------------------------------------------------------------- bad input


def single_line_error(call) -> str:
    with pytest.raises(RLHFInputError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_malformed_jsonl_line(tmp_path):
    path = write_text(tmp_path / "bad.jsonl", '{"prompt": "a", "response": "b"}\n\n{"prompt": "c", \n'
                                              '{"prompt": "d", "response": "e"}\n')
    message = single_line_error(lambda: load(path, "sft"))
    assert message.startswith(f"{path}:3: invalid JSON")


def test_malformed_json_array(tmp_path):
    path = write_text(tmp_path / "bad.json", '[\n  {"prompt": "a", "response": "b"},\n\n'
                                             '  {"prompt": "c" "response": "d"}\n]\n')
    message = single_line_error(lambda: load(path, "sft"))
    assert message.startswith(f"{path}:4: invalid JSON")


@pytest.mark.parametrize(("text", "line", "words"), [
    ('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d"}\n', 2, "extra data"),  # JSONL saved as .json
    ('[{"prompt": "a", "response": "b"}]\n[{"prompt": "c", "response": "d"}]\n', 2, "extra data"),  # two arrays
    ('[\n {"prompt": "a", "response": "b"}\n {"prompt": "c", "response": "d"}\n]\n', 3, "expected ','"),  # no comma
    ('[\n {"prompt": "a", "response": "b"},\n]\n', 3, "comma before ']'"),  # trailing comma
    ('[\n {"prompt": "a", "response": "b"}\n', 2, "expected ','"),  # no closing bracket
])
def test_json_file_records_are_never_silently_dropped(tmp_path, text, line, words):
    """A .json file is one JSON value, read strictly like json.load: what follows it or a missing
    comma is an error at its line, not records lost (the lenient reader kept 1 of 20 JSONL lines)."""
    path = write_text(tmp_path / "data.json", text)
    message = single_line_error(lambda: load(path, "sft"))
    assert message.startswith(f"{path}:{line}: ") and words in message, message


def test_strict_json_reader_keeps_valid_files(tmp_path):
    records = [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(3)]
    for text, expected in ((json.dumps(records), 3), (json.dumps(records, indent=2) + "\n\n", 3),
                           (" " + json.dumps(records[0]) + "\n", 1)):
        path = write_text(tmp_path / "ok.json", text)
        assert [r["response"] for r in load(path, "sft")] == [f"r{i}" for i in range(expected)]


def test_pairs_with_the_same_chosen_and_rejected_are_skipped_and_counted(tmp_path):
    rows = [{"prompt": "q1", "chosen": "a", "rejected": "b"}, {"prompt": "q2", "chosen": "same", "rejected": "same "},
            {"prompt": "q3", "chosen": "c", "rejected": "d"}]
    path = write_text(tmp_path / "pairs.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    from conftest import captured_log

    with captured_log() as records:
        kept = load(path, "preference")
    assert [r["chosen"] for r in kept] == ["a", "c"]
    assert any("skipped 1 pairs whose chosen and rejected responses are the same, e.g. " + f"{path}:2" in r.getMessage()
               for r in records)


def test_missing_field_in_json_array(tmp_path):
    path = write_json(tmp_path / "bad.json", [{"prompt": "a", "response": "b"}, {"prompt": "c"}], indent=2)
    message = single_line_error(lambda: load(path, "sft"))
    assert message.startswith(f"{path}:6: ")  # the line where the second object starts
    assert "response" in message


def test_missing_prompt_field_names_it(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"instruction": "i", "output": "o"}, {"input": "x", "output": "o",
                                                                                      "instruction": None}])
    message = single_line_error(lambda: load(path, "sft"))
    assert message.startswith(f"{path}:2: record has no 'instruction' field")


def test_wrong_type(tmp_path):
    path = write_text(tmp_path / "bad.jsonl", '{"prompt": "a", "response": "b"}\n{"prompt": "a", "response": 42}\n')
    message = single_line_error(lambda: load(path, "sft"))
    assert message.startswith(f"{path}:2: field 'response' must be a string, got int")


def test_missing_value_in_parquet_names_row(tmp_path):
    from datasets import Dataset

    path = tmp_path / "bad.parquet"
    Dataset.from_list([{"prompt": "a", "response": "b"}, {"prompt": None, "response": "d"}]).to_parquet(str(path))
    message = single_line_error(lambda: load(path, "sft"))
    assert message.startswith(f"{path}:row 2: record has no 'prompt' field")


def test_wrong_type_in_parquet_names_row(tmp_path):
    from datasets import Dataset

    path = tmp_path / "bad.parquet"
    Dataset.from_list([{"prompt": "a", "response": 1}]).to_parquet(str(path))
    message = single_line_error(lambda: load(path, "sft"))
    assert message.startswith(f"{path}:row 1: field 'response' must be a string")


@pytest.mark.parametrize("response", ["", "   \n"])
def test_empty_completion(tmp_path, response):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "response": "b"}] * 2 +
                       [{"prompt": "a", "response": response}])
    message = single_line_error(lambda: load(path, "sft"))
    assert message.startswith(f"{path}:3: response (completion) is empty")


def test_empty_prompt(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": " ", "response": "b"}])
    assert single_line_error(lambda: load(path, "sft")).startswith(f"{path}:1: the prompt is empty")


def test_empty_chosen(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "chosen": "", "rejected": "r"}])
    assert single_line_error(lambda: load(path, "preference")).startswith(f"{path}:1: 'chosen' response is empty")


def test_unknown_format(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "response": "b"}, {"question": "q", "reply": "r"}])
    message = single_line_error(lambda: load(path, "sft"))
    assert message.startswith(f"{path}:2: unknown record format (keys: question, reply)")


def test_record_not_an_object(tmp_path):
    path = write_text(tmp_path / "bad.jsonl", '{"prompt": "a", "response": "b"}\n[1, 2]\n')
    assert single_line_error(lambda: load(path, "sft")).startswith(f"{path}:2: a record must be")


def test_roles_not_alternating(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]},
        {"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"},
                           {"from": "gpt", "value": "c"}]}])
    message = single_line_error(lambda: load(path, "sft"))
    assert message.startswith(f"{path}:2: messages must alternate user/assistant; message 2 is 'user'")


def test_unknown_role(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"conversations": [{"from": "robot", "value": "a"}]}])
    message = single_line_error(lambda: load(path, "sft"))
    assert message.startswith(f"{path}:1: message 1 has role 'robot'")


def test_unregistered_dataset_suggests(tmp_path):
    write_jsonl(tmp_path / "x.jsonl", ROWS)
    write_json(tmp_path / "dataset_info.json", {"my_dataset": {"file_name": "x.jsonl"}})
    message = single_line_error(lambda: rlhf.load_records("my_datset", tmp_path, "sft"))
    assert "dataset 'my_datset' is not in" in message and "did you mean 'my_dataset'" in message


@pytest.mark.parametrize(("dataset", "fragment"), [
    ("", "config field 'dataset' is empty"),
    ("nothing_here", "neither a file nor registered"),
    ("notes.txt", "unsupported file type '.txt'"),
    ("empty_dir", "holds no"),
    ("missing.jsonl", "dataset file missing.jsonl does not exist"),  # a path, not a registered name
    ("sub/missing", "dataset file sub/missing does not exist"),
])
def test_dataset_resolution_errors(tmp_path, dataset, fragment):
    write_text(tmp_path / "notes.txt", "hi")
    (tmp_path / "empty_dir").mkdir()
    assert fragment in single_line_error(lambda: rlhf.load_records(dataset, tmp_path, "sft"))


def test_registry_names_missing_file(tmp_path):
    write_json(tmp_path / "dataset_info.json", {"gone": {"file_name": "gone.jsonl"}})
    assert "does not exist" in single_line_error(lambda: rlhf.load_records("gone", tmp_path, "sft"))


def test_invalid_registry_json(tmp_path):
    write_text(tmp_path / "dataset_info.json", '{\n  "a": {"file_name": "a.jsonl"},\n  oops\n}\n')
    message = single_line_error(lambda: rlhf.load_records("a", tmp_path, "sft"))
    assert message.startswith(f"{tmp_path / 'dataset_info.json'}:3: invalid JSON")


def test_skip_invalid_counts_and_warns(tmp_path, caplog):
    path = write_text(tmp_path / "mixed.jsonl", "\n".join([
        '{"prompt": "a", "response": "b"}',
        '{"prompt": "a", "response": 3}',
        '{"prompt": "c", "response": "d"}',
        '{"prompt": "e"}',
        '{"prompt": "f", "response": "g"}']) + "\n")
    with rlhf_log(caplog, logging.WARNING):
        records = load(path, "sft", skip_invalid=True)
    assert [r["location"] for r in records] == [f"{path}:1", f"{path}:3", f"{path}:5"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "skipped 2 invalid records" in warnings[0]
    assert f"{path}:2" in warnings[0] and f"{path}:4" in warnings[0]


def test_skip_invalid_with_max_samples_counts_only_valid(tmp_path):
    path = write_text(tmp_path / "mixed.jsonl", '{"prompt": "a"}\n{"prompt": "b", "response": "c"}\n'
                                                '{"prompt": "d", "response": "e"}\n')
    records = load(path, "sft", skip_invalid=True, max_samples=2)
    assert [r["response"] for r in records] == ["c", "e"]


def test_skip_invalid_still_fails_when_nothing_is_left(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    assert "has no usable sft records" in single_line_error(lambda: load(path, "sft", skip_invalid=True))


def test_skip_invalid_does_not_hide_broken_json(tmp_path):
    path = write_text(tmp_path / "bad.jsonl", '{"prompt": "a", "response": "b"}\n{oops\n')
    with pytest.raises(RLHFInputError, match=rf"^{path}:2: invalid JSON"):
        load(path, "sft", skip_invalid=True)


# ---------------------------------------------------------------- chat templates

END_MARKERS = {"chatml": "<|im_end|>\n", "qwen": "<|im_end|>\n", "qwen3_nothink": "<|im_end|>\n",
               "auto": "<|im_end|>\n"}
TEMPLATES = ("default", "chatml", "qwen", "qwen3_nothink", "auto")  # the ones the tiny tokenizer can write


def trained_text(tokenizer, template: str, response: str) -> str:
    """What the loss should see for one assistant turn: the response and the template's end marker."""
    if template == "default":  # 'Assistant:' + ' ' + content + eos + newline
        return " " + response + tokenizer.eos_token + "\n"
    return response + END_MARKERS[template]


def label_segments(ids: list[int], labels: list[int]) -> list[list[int]]:
    """Runs of consecutive trained positions (label == input id)."""
    segments, current = [], []
    for token, label in zip(ids, labels):
        if label == IGNORE_INDEX:
            if current:
                segments.append(current)
            current = []
        else:
            assert label == token
            current.append(label)
    if current:
        segments.append(current)
    return segments


def test_auto_template_uses_tokenizer_template(tiny_tokenizer):
    formatter = ChatFormatter(tiny_tokenizer, "auto")
    assert formatter.name == "tokenizer" and formatter.source == tiny_tokenizer.chat_template
    assert tiny_tokenizer.eos_token_id in formatter.stop_token_ids


def test_auto_template_without_tokenizer_template(tiny_tokenizer):
    bare = copy.deepcopy(tiny_tokenizer)
    bare.chat_template = None
    assert ChatFormatter(bare, "auto").name == "default"
    with pytest.raises(RLHFInputError, match="config field 'template' is 'vicuna'"):
        ChatFormatter(bare, "vicuna")


def test_unknown_template_is_an_error_with_a_suggestion(tiny_tokenizer):
    with pytest.raises(rlhf.RLHFInputError, match="'qwen3_nothnk'.*did you mean 'qwen3_nothink'") as error:
        ChatFormatter(tiny_tokenizer, "qwen3_nothnk")
    assert "\n" not in str(error.value)
    with pytest.raises(rlhf.RLHFInputError, match="'vicuna'.*valid: auto"):  # no fallback to the tokenizer's own
        ChatFormatter(tiny_tokenizer, "vicuna")


@pytest.mark.parametrize("system", ["", "You are terse."])
@pytest.mark.parametrize("template", TEMPLATES)
def test_conversation_masks_prompt(tiny_tokenizer, template, system):
    formatter = ChatFormatter(tiny_tokenizer, template)
    rec = record("What is 12 + 7?", "12 + 7 = 19\nAnswer: 19", system=system)
    ids, labels = formatter.conversation(rec)
    prompt = formatter.prompt_ids(rec)
    completion = formatter.completion_ids(rec, rec["response"])
    assert prompt + completion == ids
    assert len(ids) == len(labels)
    assert labels[:len(prompt)] == [IGNORE_INDEX] * len(prompt)
    assert labels[len(prompt):] == ids[len(prompt):]
    assert tiny_tokenizer.decode(labels[len(prompt):]) == trained_text(tiny_tokenizer, template, rec["response"])
    full = formatter.render(system, rec["messages"] + [assistant(rec["response"])], add_generation_prompt=False)
    assert tiny_tokenizer.decode(ids) == full
    if system:
        assert system in tiny_tokenizer.decode(prompt)


@pytest.mark.parametrize("template", TEMPLATES)
def test_train_on_prompt(tiny_tokenizer, template):
    formatter = ChatFormatter(tiny_tokenizer, template)
    ids, labels = formatter.conversation(record("Hi", "Hello"), train_on_prompt=True)
    assert labels == ids


@pytest.mark.parametrize("template", TEMPLATES)
def test_multi_turn_masks(tiny_tokenizer, template):
    formatter = ChatFormatter(tiny_tokenizer, template)
    rec = record("u2 question", "a2 answer", system="S",
                 history=[user("u1 question"), assistant("a1 answer")])
    ids, labels = formatter.conversation(rec)
    decoded = [tiny_tokenizer.decode(s) for s in label_segments(ids, labels)]
    assert decoded == [trained_text(tiny_tokenizer, template, "a1 answer"),
                       trained_text(tiny_tokenizer, template, "a2 answer")]
    masked = tiny_tokenizer.decode([t for t, lab in zip(ids, labels) if lab == IGNORE_INDEX])
    assert "u1 question" in masked and "u2 question" in masked and "answer" not in masked

    ids_h, labels_h = formatter.conversation(rec, mask_history=True)
    assert ids_h == ids
    assert [tiny_tokenizer.decode(s) for s in label_segments(ids_h, labels_h)] == [decoded[-1]]
    # the last turn is the generation target: prompt_ids + completion_ids == the whole conversation
    assert formatter.prompt_ids(rec) + formatter.completion_ids(rec, "a2 answer") == ids
    # train_on_prompt + mask_history: prompts are trained, earlier answers stay masked
    _, labels_p = formatter.conversation(rec, train_on_prompt=True, mask_history=True)
    history_answer = [t for t, lab in zip(ids, labels_p) if lab == IGNORE_INDEX]
    assert tiny_tokenizer.decode(history_answer) == decoded[0]


def test_template_whose_conversation_does_not_start_with_its_prompt_trains_what_generation_sees(tiny_tokenizer):
    """Mistral-Nemo's template drops the system prompt from a finished conversation: the trained text is the
    prompt as generation renders it, followed by the answer as the template writes it after a prompt."""
    odd = copy.deepcopy(tiny_tokenizer)
    odd.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{% if add_generation_prompt %}{{ 'S:' + m['content'] + '\\n' }}{% endif %}"
                         "{% elif m['role'] == 'user' %}{{ 'U:' + m['content'] + '\\n' }}"
                         "{% else %}{{ 'A:' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}A:{% endif %}")
    formatter = ChatFormatter(odd, "auto")
    rec = {**record("q", "a", system="be brief"), "location": "f.jsonl:7"}
    ids, labels = formatter.conversation(rec)
    assert ids == odd("S:be brief\nU:q\nA:a\n", add_special_tokens=False)["input_ids"]
    assert odd.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]) == "a\n"


@pytest.mark.parametrize("source", [
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}",  # drops answers
    # never a prefix
    "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<GEN>{% endif %}",
    "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}{% if add_generation_prompt %}:{% endif %}",
])
def test_template_that_hides_the_answer_is_an_error_naming_the_record(tiny_tokenizer, source):
    odd = copy.deepcopy(tiny_tokenizer)
    odd.chat_template = source
    rec = {**record("q", "a"), "location": "f.jsonl:7"}
    with pytest.raises(RLHFInputError, match=r"^f\.jsonl:7: chat template 'tokenizer'"):
        ChatFormatter(odd, "auto").conversation(rec)


def test_template_whose_markers_the_tokenizer_lacks_is_an_error_naming_them(tiny_tokenizer):
    with pytest.raises(RLHFInputError, match=r"'llama3' writes <\|start_header_id\|>, <\|end_header_id\|>, "
                                             r"<\|eot_id\|>.*lacks"):
        ChatFormatter(tiny_tokenizer, "llama3")
    ChatFormatter(tiny_tokenizer, "chatml")  # the tiny tokenizer has ChatML's two


# ---------------------------------------------------------------- truncation, SFTDataset, cache


def test_truncate_example():
    ids, labels = [1, 2, 3, 4, 5], [IGNORE_INDEX, IGNORE_INDEX, 3, 4, 5]
    assert rlhf.truncate_example(ids, labels, 5) == (ids, labels, "ok")
    assert rlhf.truncate_example(ids, labels, 10) == (ids, labels, "ok")
    assert rlhf.truncate_example(ids, labels, 3) == ([1, 2, 3], [IGNORE_INDEX, IGNORE_INDEX, 3], "truncated")
    assert rlhf.truncate_example(ids, labels, 2) == ([], [], "dropped")


@pytest.fixture(scope="module")
def chatml(tiny_tokenizer) -> ChatFormatter:
    return ChatFormatter(tiny_tokenizer, "chatml")


def sft_records(n: int, start: int = 0) -> list[dict]:
    return [record(f"What is {i} + {i}?", f"{i} + {i} = {2 * i}\nAnswer: {2 * i}") for i in range(start, start + n)]


def test_sft_dataset_items_and_stats(tmp_path, tiny_tokenizer, chatml, caplog):
    short = sft_records(3)
    long_response = record("Hi", "word " * 40)
    long_prompt = record("word " * 60, "ok")
    records = [*short, long_response, long_prompt]
    cutoff = max(len(chatml.conversation(r)[0]) for r in short)
    assert len(chatml.prompt_ids(long_prompt)) > cutoff and len(chatml.prompt_ids(long_response)) < cutoff
    with rlhf_log(caplog, logging.WARNING):
        dataset = rlhf.SFTDataset(records, tiny_tokenizer, chatml, cutoff_len=cutoff, cache_dir=tmp_path)
    assert dataset.stats == {"records": 5, "truncated": 1, "dropped": 1}
    assert any("truncated 1 and dropped 1 of 5" in r.getMessage() for r in caplog.records)
    assert len(dataset) == 4
    for i, rec in enumerate(short):
        ids, labels = chatml.conversation(rec)
        assert dataset[i] == {"input_ids": ids, "labels": labels}
    assert len(dataset[3]["input_ids"]) == cutoff
    assert all(len(dataset[i]["input_ids"]) <= cutoff for i in range(len(dataset)))


def test_sft_dataset_all_dropped(tmp_path, tiny_tokenizer, chatml):
    with pytest.raises(RLHFInputError, match="config field 'cutoff_len' \\(4\\) leaves no trainable record"):
        rlhf.SFTDataset(sft_records(2), tiny_tokenizer, chatml, cutoff_len=4, cache_dir=tmp_path)


def test_sft_dataset_train_on_prompt_and_mask_history(tmp_path, tiny_tokenizer, chatml):
    rec = record("u2", "a2", history=[user("u1"), assistant("a1")])
    plain = rlhf.SFTDataset([rec], tiny_tokenizer, chatml, cutoff_len=256, cache_dir=tmp_path)[0]
    on_prompt = rlhf.SFTDataset([rec], tiny_tokenizer, chatml, cutoff_len=256, cache_dir=tmp_path,
                                train_on_prompt=True)[0]
    last_only = rlhf.SFTDataset([rec], tiny_tokenizer, chatml, cutoff_len=256, cache_dir=tmp_path,
                                mask_history=True)[0]
    assert on_prompt["labels"] == on_prompt["input_ids"]
    trained = [sum(lab != IGNORE_INDEX for lab in item["labels"]) for item in (plain, last_only)]
    assert trained[0] > trained[1] > 0
    assert len(list((tmp_path / "tokenized").glob("sft-*.arrow"))) == 3  # settings are part of the cache key


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tokenisation_cache_is_reused(tmp_path, monkeypatch, tiny_tokenizer):
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path / "cache"))
    records = sft_records(30)
    first = rlhf.SFTDataset(records, tiny_tokenizer, ChatFormatter(tiny_tokenizer, "chatml"), cutoff_len=64)
    (cached,) = (tmp_path / "cache" / "tokenized").glob("sft-*.arrow")
    stamp, digest = cached.stat().st_mtime_ns, _digest(cached)

    def refuse(*args, **kwargs):
        raise AssertionError("the second build re-tokenised instead of reading the cache")

    formatter = ChatFormatter(tiny_tokenizer, "chatml")
    formatter.conversation = refuse
    second = rlhf.SFTDataset(records, tiny_tokenizer, formatter, cutoff_len=64)
    assert list((tmp_path / "cache" / "tokenized").glob("sft-*.arrow")) == [cached]
    assert cached.stat().st_mtime_ns == stamp and _digest(cached) == digest
    assert [second[i] for i in range(30)] == [first[i] for i in range(30)]
    # other inputs get their own cache file
    rlhf.SFTDataset(sft_records(30, start=1), tiny_tokenizer, ChatFormatter(tiny_tokenizer, "chatml"), cutoff_len=64)
    assert len(list((tmp_path / "cache" / "tokenized").glob("sft-*.arrow"))) == 2


# ---------------------------------------------------------------- packing and collator


def test_pack_sequences():
    examples = [([1, 2, 3], [IGNORE_INDEX, 2, 3]), ([4, 5, 6, 7], [IGNORE_INDEX, IGNORE_INDEX, 6, 7]),
                ([8, 9, 10, 11, 12], [8, 9, 10, 11, 12])]
    rows = rlhf.pack_sequences(examples, cutoff_len=8)
    assert rows == [
        {"input_ids": [1, 2, 3, 4, 5, 6, 7], "labels": [IGNORE_INDEX, 2, 3, IGNORE_INDEX, IGNORE_INDEX, 6, 7],
         "position_ids": [0, 1, 2, 0, 1, 2, 3]},
        {"input_ids": [8, 9, 10, 11, 12], "labels": [IGNORE_INDEX, 9, 10, 11, 12], "position_ids": [0, 1, 2, 3, 4]},
    ]
    assert rlhf.pack_sequences([], 8) == []
    assert len(rlhf.pack_sequences(examples, cutoff_len=12)) == 1


def test_sft_dataset_packing(tmp_path, tiny_tokenizer, chatml):
    records = sft_records(12)
    plain = rlhf.SFTDataset(records, tiny_tokenizer, chatml, cutoff_len=96, cache_dir=tmp_path)
    packed = rlhf.SFTDataset(records, tiny_tokenizer, chatml, cutoff_len=96, cache_dir=tmp_path, packing=True)
    assert len(packed) < len(plain)
    rows = [packed[i] for i in range(len(packed))]
    assert all(len(r["input_ids"]) <= 96 for r in rows)
    assert [t for r in rows for t in r["input_ids"]] == [t for i in range(len(plain)) for t in plain[i]["input_ids"]]
    starts = sum(r["position_ids"].count(0) for r in rows)
    assert starts == len(plain)


def test_collator_pads_right():
    collate = rlhf.SFTCollator(pad_token_id=0)
    batch = collate([{"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX, 6, 7]}, {"input_ids": [8], "labels": [8]}])
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 6, 7], [8, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())
    wide = rlhf.SFTCollator(pad_token_id=0, pad_to_multiple_of=4)([{"input_ids": [1, 2, 3, 4, 5], "labels": [1] * 5}])
    assert wide["input_ids"].shape == (1, 8) and wide["attention_mask"].tolist() == [[1] * 5 + [0] * 3]


def test_collator_packed_rows():
    collate = rlhf.SFTCollator(pad_token_id=0)
    batch = collate([{"input_ids": [1, 2, 3], "labels": [IGNORE_INDEX, 2, 3], "position_ids": [0, 1, 0]},
                     {"input_ids": [4], "labels": [IGNORE_INDEX], "position_ids": [0]}])
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["position_ids"].tolist() == [[0, 1, 0], [0, 0, 1]]  # padding restarts: its own "example"
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 2, 3], [IGNORE_INDEX] * 3]


@pytest.fixture(scope="module")
def packing_examples(tiny_tokenizer, chatml) -> list[tuple[list[int], list[int]]]:
    texts = [record("What is 3 + 4?", "3 + 4 = 7\nAnswer: 7"),
             record("Compute 12 + 7 - 5.", "Step 1: 12 + 7 = 19\nStep 2: 19 - 5 = 14\nAnswer: 14", system="S"),
             record("What is 99 - 9?", "99 - 9 = 90\nAnswer: 90")]
    return [chatml.conversation(r) for r in texts]


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_packed_logits_match_unpacked(tiny_arch_dir, tiny_tokenizer, packing_examples, implementation):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_arch_dir("llama"), attn_implementation=implementation).eval()
    rows = rlhf.pack_sequences(packing_examples, cutoff_len=512)
    assert len(rows) == 1
    # a second, shorter packed row makes the collator pad the batch
    short = rlhf.pack_sequences(packing_examples[:1], cutoff_len=512)[0]
    batch = rlhf.SFTCollator(pad_token_id=tiny_tokenizer.pad_token_id)([rows[0], short])
    assert "attention_mask" not in batch and "position_ids" in batch
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        offset = 0
        for ids, _ in packing_examples:
            alone = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            torch.testing.assert_close(packed[0, offset:offset + len(ids)], alone, atol=1e-5, rtol=1e-4)
            offset += len(ids)
        first = len(packing_examples[0][0])
        torch.testing.assert_close(packed[1, :first], packed[0, :first], atol=1e-5, rtol=1e-4)
        # without position ids the examples would see each other: the check above is not vacuous
        leaky = model(input_ids=batch["input_ids"][:1], use_cache=False).logits[0]
        assert not torch.allclose(leaky[first:first + 5], packed[0, first:first + 5], atol=1e-3)


# ---------------------------------------------------------------- streaming

STREAM_RECORDS = 2000


@pytest.fixture(scope="module")
def stream_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("stream") / "big.jsonl"
    return write_jsonl(path, [{"prompt": f"What is {i} + 1?", "response": f"{i} + 1 = {i + 1}\nAnswer: {i + 1}"}
                              for i in range(STREAM_RECORDS)])


def streaming(path: Path, tokenizer, formatter, **kwargs) -> rlhf.StreamingSFTDataset:
    return rlhf.StreamingSFTDataset(rlhf.resolve_dataset(str(path), path.parent), tokenizer, formatter,
                                    cutoff_len=64, **kwargs)


@pytest.fixture(scope="module")
def streamed_items(stream_file, tiny_tokenizer, chatml) -> list[dict]:
    dataset = streaming(stream_file, tiny_tokenizer, chatml)
    items = list(dataset)
    assert dataset.stats == {"records": STREAM_RECORDS, "truncated": 0, "dropped": 0, "invalid": 0}
    return items


def test_streaming_matches_in_memory(stream_file, streamed_items, tiny_tokenizer, chatml, tmp_path):
    records = load(stream_file, "sft")
    in_memory = rlhf.SFTDataset(records, tiny_tokenizer, chatml, cutoff_len=64, cache_dir=tmp_path)
    assert len(streamed_items) == len(in_memory) == STREAM_RECORDS
    assert all(in_memory[i] == streamed_items[i] for i in range(STREAM_RECORDS))


@pytest.mark.parametrize("k", [1, 251])
def test_streaming_resume(stream_file, streamed_items, tiny_tokenizer, chatml, k):
    first = streaming(stream_file, tiny_tokenizer, chatml)
    iterator = iter(first)
    seen = [next(iterator) for _ in range(k)]
    assert seen == streamed_items[:k]
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints store it as JSON
    resumed = streaming(stream_file, tiny_tokenizer, chatml)
    resumed.load_state_dict(state)
    following = iter(resumed)
    assert [next(following) for _ in range(5)] == streamed_items[k:k + 5]
    assert resumed.stats["records"] == k + 5


def test_streaming_shards_partition(stream_file, streamed_items, tiny_tokenizer, chatml):
    shards = [list(streaming(stream_file, tiny_tokenizer, chatml, rank=r, world_size=2)) for r in (0, 1)]
    keys = [{tuple(item["input_ids"]) for item in shard} for shard in shards]
    assert all(len(k) == len(s) for k, s in zip(keys, shards))  # no repeats inside a shard
    assert not keys[0] & keys[1]
    assert keys[0] | keys[1] == {tuple(item["input_ids"]) for item in streamed_items}
    assert abs(len(shards[0]) - len(shards[1])) <= 1


def test_streaming_invalid_records(tmp_path, tiny_tokenizer, chatml):
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"},
                                              {"prompt": "e"}, {"prompt": "f", "response": "g"}])
    with pytest.raises(RLHFInputError, match=r"record 3\).*no response"):
        list(streaming(path, tiny_tokenizer, chatml))
    dataset = streaming(path, tiny_tokenizer, chatml, skip_invalid=True)
    assert len(list(dataset)) == 3 and dataset.stats["invalid"] == 1


def test_streaming_error_location_on_second_rank(tmp_path, tiny_tokenizer, chatml):
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "a", "response": "b"}] * 3 + [{"prompt": "e"}])
    with pytest.raises(RLHFInputError) as info:
        list(streaming(path, tiny_tokenizer, chatml, rank=1, world_size=2))
    message = str(info.value)
    assert "(record 4)" in message or f"{path}:4" in message, message


def test_streaming_max_samples_and_skip(stream_file, streamed_items, tiny_tokenizer, chatml):
    dataset = streaming(stream_file, tiny_tokenizer, chatml, max_samples=50, skip=10)
    assert list(dataset) == streamed_items[10:50]
    assert dataset.stats["records"] == 40


def test_streaming_val_size_takes_the_first_records(stream_file, tiny_tokenizer, chatml):
    config = rlhf.SFTConfig(dataset=str(stream_file), dataset_dir=str(stream_file.parent), streaming=True,
                            max_steps=5, val_size=7, max_samples=30, output_dir="unused")
    train_records, val_records, _ = rlhf.read_sft_records(config)
    assert train_records is None and [r["response"].split(" ")[0] for r in val_records] == [str(i) for i in range(7)]
    train, validation, _ = rlhf.build_sft_data(config, tiny_tokenizer, chatml, rlhf.DeviceManager())
    assert len(validation) == 7 and len(list(train)) == 23


def test_streaming_val_size_fraction_is_an_input_error(stream_file):
    config = rlhf.SFTConfig(dataset=str(stream_file), dataset_dir=str(stream_file.parent), streaming=True,
                            max_steps=5, val_size=0.1, output_dir="unused")
    with pytest.raises(RLHFInputError, match="val_size.*record count"):
        rlhf.read_sft_records(config)


def test_streaming_needs_local_files(tiny_tokenizer, chatml):
    spec = rlhf.DatasetSpec(name="hub", hub={"path": "x/y"})
    with pytest.raises(RLHFInputError, match="streaming reads local files only"):
        rlhf.StreamingSFTDataset(spec, tiny_tokenizer, chatml, cutoff_len=64)


# ---------------------------------------------------------------- answers


@pytest.mark.parametrize(("text", "answer"), [
    ("12 + 7 = 19\nAnswer: 19", "19"),
    ("Answer: 3\nAnswer: 4", "4"),  # the last one counts
    ("Step 1: 5 - 9 = -4\nAnswer: -4", "-4"),
    ("Answer:12", "12"),
    ("Answer:   2.50", "2.50"),
    ("12 + 7 = 19", None),
    ("Answer: nineteen", None),
    ("", None),
])
def test_extract_answer(text, answer):
    assert rlhf.extract_answer(text) == answer


def test_extract_answer_on_demo_data(repo):
    records = rlhf.load_records("demo_sft", repo / "data" / "demo", "sft", max_samples=200)
    with_answer = [r for r in records if "Answer:" in r["response"]]
    assert with_answer
    for r in with_answer:
        assert rlhf.extract_answer(r["response"]) == r["response"].rsplit("Answer:", 1)[1].strip()


def test_dataset_info_that_is_not_a_mapping(tmp_path):
    write_json(tmp_path / "dataset_info.json", [{"file_name": "x.jsonl"}])
    message = single_line_error(lambda: rlhf.load_records("mine", tmp_path, "sft"))
    assert message.endswith("must be a JSON object of name: entry (LLaMA-Factory's layout), not a list")


# -- validation split by prompt -----------------------------------------------------------------------------


def _pairs_with_repeated_prompts() -> list[dict]:
    """30 prompts, prompt k with k % 3 + 1 pairs (60 records), in the shape load_records returns."""
    return [{"system": "", "messages": [{"role": "user", "content": f"prompt {k}"}], "chosen": f"c{k}.{j}",
             "rejected": f"r{k}.{j}"} for k in range(30) for j in range(k % 3 + 1)]


def test_val_split_by_prompt_keeps_every_prompt_on_one_side():
    records = _pairs_with_repeated_prompts()
    prompt = lambda r: r["messages"][0]["content"]  # noqa: E731
    train, held = rlhf._split_validation(records, 10, seed=0)
    assert len(held) == 10 and {prompt(r) for r in train} & {prompt(r) for r in held}  # record-level: shared
    train, held = rlhf._split_validation(records, 10, seed=0, by_prompt=True)
    assert not {prompt(r) for r in train} & {prompt(r) for r in held}
    assert 10 <= len(held) <= 12 and len(train) + len(held) == len(records)  # whole prompts: up to 2 more
    counts = {p: sum(prompt(r) == p for r in records) for p in {prompt(r) for r in held}}
    assert all(sum(prompt(r) == p for r in held) == n for p, n in counts.items())  # every pair of a held prompt
    assert rlhf._split_validation(records, 10, seed=0, by_prompt=True) == (train, held)  # seeded
    assert rlhf._split_validation(records, 10, seed=1, by_prompt=True)[1] != held
    assert len(rlhf._split_validation(records, 0.5, seed=0, by_prompt=True)[1]) >= 30


def test_val_split_by_prompt_errors_in_one_line(stream_file):
    records = [{"system": "", "messages": [{"role": "user", "content": "same"}], "chosen": str(i), "rejected": "x"}
               for i in range(5)]
    with pytest.raises(RLHFInputError, match="holds out every prompt"):
        rlhf._split_validation(records, 2, seed=0, by_prompt=True)
    with pytest.raises(RLHFInputError, match="val_split_by_prompt"):
        rlhf.SFTConfig(dataset=str(stream_file), streaming=True, max_steps=5, val_size=7, val_split_by_prompt=True,
                       output_dir="unused")


def test_reward_model_config_splits_by_prompt(demo_dir):
    config = rlhf.RewardModelConfig(dataset="demo_rm", dataset_dir=str(demo_dir), val_size=200,
                                    val_split_by_prompt=True, output_dir="unused")
    train, held, _ = rlhf.read_stage_records(config, "preference")
    prompt = lambda r: r["messages"][0]["content"]  # noqa: E731
    assert len(held) >= 200 and not {prompt(r) for r in train} & {prompt(r) for r in held}


# ---------------------------------------------------------------- tools (LLaMA-Factory's function_call / observation)


REAL_MODELS_DATA = Path(__file__).parent / "data" / "real_models"


def test_tool_records_read_as_calls_results_and_schemas():
    records = rlhf.load_records("real_tools", REAL_MODELS_DATA, "sft")
    first, call_only = records[0], records[1]
    assert [m["role"] for m in first["messages"]] == ["user", "assistant", "tool"]
    call = first["messages"][1]["tool_calls"][0]
    assert call["function"] == {"name": "add", "arguments": {"a": 12, "b": 7}} and len(call["id"]) == 9
    assert first["messages"][2] == {"role": "tool", "content": "19", "tool_call_id": call["id"]}
    assert first["response"] == "12 + 7 = 19." and "response_message" not in first
    assert [t["function"]["name"] for t in first["tools"]] == ["add", "lookup_capital"]
    assert call_only["response_message"]["tool_calls"][0]["function"]["name"] == "lookup_capital"
    assert json.loads(call_only["response"]) == [{"name": "lookup_capital", "arguments": {"country": "France"}}]


@pytest.mark.parametrize("turn,message", [
    ({"from": "function_call", "value": "add(1, 2)"}, r"message 2 \(a function call\) is not JSON"),
    ({"from": "function_call", "value": '{"arguments": {}}'},
     r"message 2 \(a function call\) must hold \"name\" and \"arguments\""),
])
def test_a_bad_function_call_is_one_line_naming_its_line(tmp_path, turn, message):
    row = {"conversations": [{"from": "human", "value": "hi"}, turn]}
    (tmp_path / "tools.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(RLHFInputError, match=r"tools\.jsonl:1: " + message):
        rlhf.load_records(str(tmp_path / "tools.jsonl"), tmp_path, "sft")


def test_bad_tools_and_a_kto_answer_that_calls_a_tool_are_errors(tmp_path):
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}], "tools": "[add]"}
    (tmp_path / "a.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(RLHFInputError, match=r"a\.jsonl:1: field 'tools' is not JSON"):
        rlhf.load_records(str(tmp_path / "a.jsonl"), tmp_path, "sft")
    call = {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 1, "b": 2}}'}
    (tmp_path / "b.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}, call],
                                                  "label": True}) + "\n")
    with pytest.raises(RLHFInputError, match=r"b\.jsonl:1: the answer is a function call"):
        rlhf.load_records(str(tmp_path / "b.jsonl"), tmp_path, "kto")


@pytest.mark.parametrize("template", ["empty", "default"])
def test_multi_turn_templates_without_an_end_marker_train_each_whole_answer(tiny_tokenizer, template):
    """'empty' writes nothing after an answer and 'default' only a newline when the tokenizer has no EOS: each
    earlier answer is trained up to its own end, multi-line answers whole."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    if template == "default":
        tokenizer.eos_token = None
    history = [user("What is 1 + 1?"), {"role": "assistant", "content": "line one\nline two"}]
    rec = record("And 2 + 2?", "4", history=history)
    ids, labels = ChatFormatter(tokenizer, template).conversation(rec)
    runs = [tokenizer.decode(run) for run in label_segments(ids, labels)]
    assert [run.strip() for run in runs] == ["line one\nline two", "4"]
