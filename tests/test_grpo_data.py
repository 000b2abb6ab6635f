"""Prompt datasets for online RL (groundwork for GRPO/PPO): the answer travels with its prompt,
every prompt format loads, long prompts keep their end and are counted, and the streaming twin
yields the same items and resumes from its position."""

from __future__ import annotations

import json
from pathlib import Path

import rlhf


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_demo_rl_prompts_carry_their_answers(repo, tiny_tokenizer):
    formatter = rlhf.ChatFormatter(tiny_tokenizer)
    records = rlhf.load_records("demo_rl", repo / "data" / "demo", "prompt", max_samples=20)
    dataset = rlhf.GRPODataset(records, tiny_tokenizer, formatter, cutoff_len=128)
    assert len(dataset) == 20 and dataset.stats["truncated"] == 0
    for record, item in zip(records, (dataset[i] for i in range(20))):
        assert item["answer"] == record["answer"] and item["verifiable"] is True
        assert item["prompt_ids"] == formatter.prompt_ids(record)  # ends with the assistant header
    assert dataset.lengths() == [len(dataset[i]["prompt_ids"]) for i in range(20)]


def test_prompt_formats_and_truncation(tmp_path, tiny_tokenizer):
    formatter = rlhf.ChatFormatter(tiny_tokenizer)
    strings = _write(tmp_path / "strings.jsonl", ["What is 1 + 2?", "What is 3 + 4?"])
    plain = _write(tmp_path / "plain.jsonl", [{"prompt": "What is 5 + 6?"}])
    for path, count in ((strings, 2), (plain, 1)):
        dataset = rlhf.GRPODataset(rlhf.load_records(path.name, tmp_path, "prompt"), tiny_tokenizer, formatter,
                                   cutoff_len=128)
        assert len(dataset) == count and all(dataset[i]["answer"] is None for i in range(count))
    long = _write(tmp_path / "long.jsonl", [{"prompt": "What is 1 + 1? " * 50, "answer": "2"}])
    record = rlhf.load_records(long.name, tmp_path, "prompt")
    dataset = rlhf.GRPODataset(record, tiny_tokenizer, formatter, cutoff_len=16)
    assert dataset.stats["truncated"] == 1
    assert dataset[0]["prompt_ids"] == formatter.prompt_ids(record[0])[-16:]  # the end, next to generation


def test_streaming_grpo_matches_in_memory_and_resumes(repo, tiny_tokenizer):
    formatter = rlhf.ChatFormatter(tiny_tokenizer)
    demo = repo / "data" / "demo"
    in_memory = rlhf.GRPODataset(rlhf.load_records("demo_rl", demo, "prompt", max_samples=12), tiny_tokenizer,
                                 formatter, cutoff_len=128)
    spec = rlhf.resolve_dataset("demo_rl", demo)
    streamed = list(rlhf.StreamingGRPODataset(spec, tiny_tokenizer, formatter, cutoff_len=128, max_samples=12))
    assert streamed == [in_memory[i] for i in range(12)]
    first = rlhf.StreamingGRPODataset(spec, tiny_tokenizer, formatter, cutoff_len=128, max_samples=12)
    iterator = iter(first)
    [next(iterator) for _ in range(5)]
    resumed = rlhf.StreamingGRPODataset(spec, tiny_tokenizer, formatter, cutoff_len=128, max_samples=12)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert list(resumed) == streamed[5:]
