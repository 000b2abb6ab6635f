"""Tokenization on real tokenizers and chat templates (tests/real_models.py builds them offline): the tokens we
train on are the ones the model's own template gives for the whole conversation, the loss covers exactly the
assistant turns, the LLaMA-Factory template names render what their families' templates render, Mistral's tokens
equal mistral-common's reference encoder, and stop tokens include the model's generation_config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import real_models

import rlhf
from rlhf import IGNORE_INDEX, ChatFormatter, RLHFInputError

FAMILIES = list(real_models.FAMILIES)
SHAPES = {
    "single": ("", [], "12 + 7 = 19\nAnswer: 19"),
    "system": ("You are a terse calculator.", [], "12 + 7 = 19\nAnswer: 19"),
    "multi": ("", [("What is 2 + 2?", "2 + 2 = 4")], "12 + 7 = 19\nAnswer: 19"),
    "multi+system": ("Answer briefly.", [("What is 2 + 2?", "2 + 2 = 4"), ("And 3 * 3?", "9")], "19"),
}
QUESTION = "What is 12 + 7?"



@pytest.fixture(scope="module", autouse=True)
def sources():
    real_models.sources_or_skip()

@pytest.fixture(scope="module")
def tokenizers():
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = real_models.load_tokenizer(name)
        return cache[name]

    return get


def record(shape: str) -> dict:
    system, history, response = SHAPES[shape]
    messages = [m for user, answer in history for m in ({"role": "user", "content": user},
                                                        {"role": "assistant", "content": answer})]
    return {"system": system, "messages": [*messages, {"role": "user", "content": QUESTION}], "response": response,
            "location": f"{shape}.jsonl:1"}


def conversation(rec: dict) -> list[dict]:
    return ([{"role": "system", "content": rec["system"]}] if rec["system"] else []) + rec["messages"] + [
        {"role": "assistant", "content": rec["response"]}]


def own_tokens(tokenizer, rec: dict) -> list[int]:
    """apply_chat_template of the whole conversation, as a user of the model would call it ('default' for a
    tokenizer without a template, as the formatter's auto)."""
    source = tokenizer.chat_template or rlhf.CHAT_TEMPLATES["default"]
    text = tokenizer.apply_chat_template(conversation(rec), chat_template=source, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def trained_runs(tokenizer, ids: list[int], labels: list[int]) -> list[str]:
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label != IGNORE_INDEX:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return ["".join(tokenizer.decode(run, skip_special_tokens=False).split()) for run in runs]


def expected_runs(family: str, rec: dict, tokenizer, thinking: bool = True) -> list[str]:
    """What each assistant turn should train, written out per family from its template (independently of the
    formatter): the answer and the end-of-turn text the template writes after it; whitespace is compared apart."""
    answers = [m["content"] for m in rec["messages"] if m["role"] == "assistant"] + [rec["response"]]
    eos = tokenizer.eos_token
    runs = []
    for number, answer in enumerate(answers):
        last = number == len(answers) - 1
        if family in ("llama3",):
            text = answer + "<|eot_id|>"
        elif family == "llama2" or family.startswith(("mistral", "mixtral")):
            text = answer + eos
        elif family.startswith("qwen3"):
            text = ("<think>\n\n</think>\n\n" if last and thinking else "") + answer + "<|im_end|>\n"
        elif family.startswith("qwen"):
            text = answer + "<|im_end|>\n"
        elif family.startswith("gemma"):
            text = answer + "<end_of_turn>\n"
        elif family == "phi3.5":
            text = answer + "<|end|>\n" + (eos if last else "")
        else:  # no template of its own: 'default', 'Assistant: ' + answer + eos + newline
            text = answer + eos + "\n"
        runs.append("".join(text.split()))
    return runs


# -- the tokens are the model's own, the loss covers exactly the assistant turns ---------------------------------


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_equal_the_models_own_template_and_labels_cover_the_answers(family, shape, tokenizers):
    tokenizer = tokenizers(family)
    rec = record(shape)
    if family == "gemma2" and rec["system"]:  # Gemma 2's own template refuses a system prompt: one line, not jinja
        with pytest.raises(RLHFInputError, match=r"^[a-z+]*system\.jsonl:1: chat template 'tokenizer' "
                                                 r"refuses this record: System role not supported.*template: gemma"):
            ChatFormatter(tokenizer, "auto").conversation(rec)
        return
    ids, labels = ChatFormatter(tokenizer, "auto").conversation(rec)
    drops_system = family.startswith(("mistral", "mixtral")) and rec["system"]
    if not drops_system:  # their own templates put the system prompt in the conversation's last turn only if it is
        assert ids == own_tokens(tokenizer, rec)  # a user turn (see the mistral-common test)
    assert trained_runs(tokenizer, ids, labels) == expected_runs(family, rec, tokenizer)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("family", [f for f in FAMILIES if real_models.FAMILIES[f].named_template != "auto"])
def test_the_familys_template_name_trains_the_same_tokens_as_its_own_template(family, shape, tokenizers):
    tokenizer = tokenizers(family)
    rec = record(shape)
    name = real_models.FAMILIES[family].named_template
    named = ChatFormatter(tokenizer, name).conversation(rec)
    if family == "gemma2" and rec["system"]:  # where Gemma 2 refuses, 'gemma' renders as Gemma 3 does
        gemma3 = ChatFormatter(tokenizers("gemma3"), "auto").conversation(rec)
        assert named == gemma3
        return
    if family.startswith(("mistral", "mixtral")) and rec["system"]:
        return  # the own template drops the system prompt; mistral-common's test covers 'mistral' here
    assert named == ChatFormatter(tokenizer, "auto").conversation(rec)


# -- Mistral: the reference encoder ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("family,template", [("mistral-v0.3", "mistral"), ("mistral-v0.3", "auto"),
                                             ("mixtral", "mistral"), ("mistral-nemo", "auto")])
def test_mistral_tokens_equal_mistral_commons_reference_encoder(family, template, shape, tokenizers):
    """mistral-common encodes a finished conversation for fine-tuning with the system prompt in its last user
    message; Mistral's own jinja templates drop it when the conversation ends with the answer."""
    mistral_common = pytest.importorskip("mistral_common")
    del mistral_common
    from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage
    from mistral_common.protocol.instruct.request import InstructRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    source = real_models.FAMILIES[family].source.split(":", 1)[1]
    reference = MistralTokenizer.from_file(str(real_models._unpacked("mistral-common") / source)).instruct_tokenizer
    rec = record(shape)
    messages = [UserMessage(content=m["content"]) if m["role"] == "user" else AssistantMessage(content=m["content"])
                for m in conversation(rec) if m["role"] != "system"]
    want = reference.encode_instruct(InstructRequest(messages=messages, system_prompt=rec["system"] or None)).tokens
    ids, labels = ChatFormatter(tokenizers(family), template).conversation(rec)
    assert ids == want


# -- each template name renders what its family's real template renders ------------------------------------------


REFERENCES = {  # template name -> (tokenizer family, the real template it must render like)
    "llama3": ("llama3", real_models.LLAMA3_TEMPLATE),
    "llama2": ("llama2", real_models.LLAMA2_TEMPLATE),
    "qwen": ("qwen2.5", "Qwen-Qwen2.5-7B-Instruct.jinja"),
    "qwen3": ("qwen3", "Qwen-Qwen3-0.6B.jinja"),
    "gemma": ("gemma3", real_models.GEMMA3_TEMPLATE),
    "gemma3": ("gemma3", real_models.GEMMA3_TEMPLATE),
    "phi": ("phi3.5", "microsoft-Phi-3.5-mini-instruct.jinja"),
    "chatml": ("qwen2.5", None),  # ChatML is Qwen2.5's format once a system prompt is given
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name,thinking", [(name, None) for name in REFERENCES] + [("qwen3", False), ("qwen3", True)])
def test_template_names_render_like_their_familys_real_template(name, thinking, shape, tokenizers):
    family, reference = REFERENCES[name]
    tokenizer = tokenizers(family)
    reference = reference if reference is None or "{" in reference else real_models.llama_cpp_template(reference)
    rec = record(shape)
    if name == "chatml" and not rec["system"]:
        rec = {**rec, "system": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."}
    source = reference or tokenizer.chat_template
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    ours = ChatFormatter(tokenizer, name, **kwargs)
    turns = conversation(rec)
    for add_generation_prompt, messages in ((True, turns[:-1]), (False, turns)):
        want = tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **kwargs)
        got = ours.render("", messages, add_generation_prompt)
        assert got == want


def test_llama3_name_renders_like_llama31_apart_from_its_dated_system_block(tokenizers):
    """Llama 3.1's own template adds 'Cutting Knowledge Date' lines to a system block it always writes; the
    'llama3' name is Llama 3.0's format, which 3.1 otherwise keeps."""
    tokenizer = tokenizers("llama3")
    rec = record("multi")
    own = tokenizer.apply_chat_template(conversation(rec), tokenize=False)
    named = ChatFormatter(tokenizer, "llama3").render("", conversation(rec), False)
    assert own.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date")
    assert own[own.index("<|eot_id|>") + len("<|eot_id|>"):] == named[len("<|begin_of_text|>"):]


# -- Qwen3's thinking switch, qwen3_nothink ------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["single", "multi+system"])
def test_qwen3_thinking_off_keeps_the_empty_reasoning_block_out_of_the_loss(shape, tokenizers):
    tokenizer = tokenizers("qwen3")
    rec = record(shape)
    thinking = ChatFormatter(tokenizer, "qwen3").conversation(rec)
    off = ChatFormatter(tokenizer, "qwen3", enable_thinking=False)
    ids, labels = off.conversation(rec)
    assert ids == thinking[0]  # the same conversation, as the model's own template renders it either way
    assert trained_runs(tokenizer, ids, labels) == expected_runs("qwen3", rec, tokenizer, thinking=False)
    assert trained_runs(tokenizer, *thinking) == expected_runs("qwen3", rec, tokenizer, thinking=True)
    assert off.prompt_text(rec).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # generation starts after it


def test_qwen3_nothink_writes_no_reasoning_block(tokenizers):
    tokenizer = tokenizers("qwen3")
    ids, labels = ChatFormatter(tokenizer, "qwen3_nothink").conversation(record("multi"))
    assert "<think>" not in tokenizer.decode(ids)
    assert trained_runs(tokenizer, ids, labels) == ["".join((a + "<|im_end|>\n").split())
                                                    for a in ("2 + 2 = 4", "12 + 7 = 19\nAnswer: 19")]


def test_enable_thinking_on_a_template_without_the_switch_is_an_error(tokenizers):
    with pytest.raises(RLHFInputError, match="'enable_thinking': chat template 'qwen3_nothink' has no thinking switch"):
        ChatFormatter(tokenizers("qwen3"), "qwen3_nothink", enable_thinking=False)


def test_saved_template_fixes_the_thinking_switch_as_trained(tokenizers):
    tokenizer = tokenizers("qwen3")
    off = ChatFormatter(tokenizer, "qwen3", enable_thinking=False)
    saved = off.saved_template()
    messages = [{"role": "user", "content": QUESTION}]
    served = tokenizer.apply_chat_template(messages, chat_template=saved, tokenize=False, add_generation_prompt=True)
    assert served == off.prompt_text(record("single"))  # HF inference with no switch renders the trained prompt


# -- markers the tokenizer lacks, stop tokens --------------------------------------------------------------------


@pytest.mark.parametrize("family,name", [("llama3", "chatml"), ("qwen2.5", "llama3"), ("llama2", "gemma"),
                                         ("gpt2", "phi"), ("qwen2.5", "qwen3")])
def test_a_template_whose_markers_the_tokenizer_lacks_is_an_error(family, name, tokenizers):
    with pytest.raises(RLHFInputError, match=rf"'{name}' writes .*which this tokenizer .*lacks as one token"):
        ChatFormatter(tokenizers(family), name)


@pytest.mark.parametrize("family", FAMILIES)
def test_stop_tokens_hold_every_generation_config_eos_and_the_end_of_turn(family, tokenizers):
    from transformers import GenerationConfig

    tokenizer = tokenizers(family)
    listed = real_models.FAMILIES[family].eos_token_id
    formatter = ChatFormatter(tokenizer, "auto", generation_config=GenerationConfig(eos_token_id=listed or None))
    assert set(listed) <= set(formatter.stop_token_ids)
    assert tokenizer.eos_token_id in formatter.stop_token_ids
    end = {"llama3": "<|eot_id|>", "qwen2.5": "<|im_end|>", "qwen3": "<|im_end|>", "qwen3-moe": "<|im_end|>",
           "gemma3": "<end_of_turn>", "gemma2": "<end_of_turn>", "phi3.5": "<|end|>"}.get(family)
    if end:
        assert tokenizer.convert_tokens_to_ids(end) in formatter.stop_token_ids


def test_no_spurious_leading_space_on_sentencepiece(tokenizers):
    """The defect: the response encoded apart from its prompt starts with a token the whole conversation lacks
    (Phi-3's normaliser puts '▁' before any text it is given)."""
    tokenizer = tokenizers("phi3.5")
    rec = {**record("single"), "response": "Sure thing"}
    apart = tokenizer("Sure thing<|end|>\n<|endoftext|>", add_special_tokens=False)["input_ids"]
    prompt, completion = ChatFormatter(tokenizer, "auto").prompt_and_completion(rec, rec["response"])
    assert tokenizer.convert_ids_to_tokens(apart[:1]) == ["▁Sure"]
    assert completion == own_tokens(tokenizer, rec)[len(prompt):]
    assert completion[0] != apart[0]  # after the template's newline the answer starts without '▁'
    assert tokenizer.decode(completion[:2]) == "Sure"


# -- tools: schemas, calls and results, where the template has them ---------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "a1b2c3d4e", "type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 7}}}]}
RESULT = {"role": "tool", "content": "19", "tool_call_id": "a1b2c3d4e"}
TOOL_FAMILIES = {"qwen2.5": "qwen", "qwen3": "qwen3", "qwen3-moe": "qwen3", "llama3": None, "mistral-nemo": None}


def tool_record(ends_with_call: bool) -> dict:
    question = {"role": "user", "content": QUESTION}
    if ends_with_call:  # the answer to train on is the call itself
        return {"system": "", "messages": [question], "tools": TOOLS, "response": "", "response_message": CALL,
                "location": "tools.jsonl:1"}
    return {"system": "", "messages": [question, CALL, RESULT], "tools": TOOLS, "response": "12 + 7 = 19",
            "location": "tools.jsonl:2"}


def tool_conversation(rec: dict) -> list[dict]:
    return rec["messages"] + [rec.get("response_message") or {"role": "assistant", "content": rec["response"]}]


@pytest.mark.parametrize("ends_with_call", [False, True])
@pytest.mark.parametrize("family", list(TOOL_FAMILIES))
def test_tool_records_tokenize_as_the_models_own_template_writes_them(family, ends_with_call, tokenizers):
    tokenizer = tokenizers(family)
    rec = tool_record(ends_with_call)
    ids, labels = ChatFormatter(tokenizer, "auto").conversation(rec)
    text = tokenizer.apply_chat_template(tool_conversation(rec), tools=TOOLS, tokenize=False)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    call, end = {  # what each family's template writes for the call, and after a turn (whitespace aside)
        "qwen2.5": ('<tool_call>{"name":"add","arguments":{"a":12,"b":7}}</tool_call>', "<|im_end|>"),
        "llama3": ('{"name":"add","parameters":{"a":12,"b":7}}', "<|eot_id|>"),
        "mistral-nemo": ('[TOOL_CALLS][{"name":"add","arguments":{"a":12,"b":7},"id":"a1b2c3d4e"}]', "</s>"),
    }[family if family in ("llama3", "mistral-nemo") else "qwen2.5"]
    final_think = "<think></think>" if family.startswith("qwen3") else ""  # Qwen3's last turn gets an empty block
    want = [final_think + call + end] if ends_with_call else [call + end, final_think + "12+7=19" + end]
    assert trained_runs(tokenizer, ids, labels) == want  # the calls and answers; the schemas and results never
    name = TOOL_FAMILIES[family]
    if name:  # the family's template name trains the same tokens
        assert ChatFormatter(tokenizer, name).conversation(rec) == (ids, labels)


@pytest.mark.parametrize("family,name", [("llama3", "llama3"), ("phi3.5", "auto"), ("qwen2.5", "chatml"),
                                         ("mistral-v0.3", "mistral")])
def test_a_template_that_cannot_write_tools_is_an_error_not_a_silent_loss(family, name, tokenizers):
    with pytest.raises(RLHFInputError, match=r"^tools\.jsonl:2: chat template '\w+' cannot write tools"):
        ChatFormatter(tokenizers(family), name).conversation(tool_record(False))


@pytest.mark.parametrize("system", ["", "Use the tools when they help."])
def test_mistral_nemo_tool_conversations_equal_mistral_commons_encoder(system, tokenizers):
    """Nemo's own template writes the tools before the last question and the system prompt into it; a
    conversation that calls a tool, reads its result, answers and goes on is encoded as mistral-common does."""
    pytest.importorskip("mistral_common")
    from mistral_common.protocol.instruct.messages import AssistantMessage, ToolMessage, UserMessage
    from mistral_common.protocol.instruct.request import InstructRequest
    from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool, ToolCall
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    source = real_models.FAMILIES["mistral-nemo"].source.split(":", 1)[1]
    reference = MistralTokenizer.from_file(str(real_models._unpacked("mistral-common") / source)).instruct_tokenizer
    history = [{"role": "user", "content": QUESTION}, CALL, RESULT, {"role": "assistant", "content": "19."},
               {"role": "user", "content": "Thanks!"}]
    rec = {"system": system, "messages": history, "tools": TOOLS, "response": "You are welcome.",
           "location": "nemo.jsonl:1"}
    call = CALL["tool_calls"][0]
    messages = [UserMessage(content=QUESTION),
                AssistantMessage(tool_calls=[ToolCall(id=call["id"], function=FunctionCall(
                    name="add", arguments=json.dumps(call["function"]["arguments"])))]),
                ToolMessage(content="19", tool_call_id=call["id"]), AssistantMessage(content="19."),
                UserMessage(content="Thanks!"), AssistantMessage(content="You are welcome.")]
    tools = [Tool(function=Function(**TOOLS[0]["function"]))]
    want = reference.encode_instruct(InstructRequest(messages=messages, available_tools=tools,
                                                     system_prompt=system or None)).tokens
    ids, labels = ChatFormatter(tokenizers("mistral-nemo"), "auto").conversation(rec)
    assert ids == want



# -- what a review found ------------------------------------------------------------------------------------------


def test_the_sft_dataset_keeps_tool_records_whole(tokenizers, tmp_path):
    """The in-memory SFT set tokenises through Arrow: tools, calls and per-record argument names must come back
    as they were (a column per field would give every call every record's argument names)."""
    tokenizer = tokenizers("qwen2.5")
    formatter = ChatFormatter(tokenizer, "qwen")
    data = Path(__file__).parent / "data" / "real_models"
    records = rlhf.load_records("real_tools", data, "sft")
    dataset = rlhf.SFTDataset(records, tokenizer, formatter, cutoff_len=4096, cache_dir=tmp_path)
    for index, rec in enumerate(records):
        ids, labels = formatter.conversation(rec)
        assert dataset[index]["input_ids"] == ids and dataset[index]["labels"] == labels


def test_qwen3_thinking_off_with_an_empty_earlier_answer_never_trains_the_next_question(tokenizers):
    tokenizer = tokenizers("qwen3")
    rec = {"system": "", "messages": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": ""},
                                      {"role": "user", "content": "Q2"}], "response": "A2", "location": "q.jsonl:1"}
    ids, labels = ChatFormatter(tokenizer, "qwen3", enable_thinking=False).conversation(rec)
    runs = trained_runs(tokenizer, ids, labels)
    assert runs == ["<|im_end|>", "A2<|im_end|>"] and not any("Q2" in run for run in runs)


def test_chat_pair_ids_on_a_template_that_drops_the_system_prompt(tokenizers):
    """Mistral-Nemo with a system prompt: the answer is what the template writes after the prompt, found without
    searching for the answer's text (a one-letter answer is inside '</s>' too)."""
    import inference_optimizations as io

    tokenizer = tokenizers("mistral-nemo")
    for response in ("s", "", "12 + 7 = 19"):
        prompt, completion = io.chat_pair_ids(tokenizer, QUESTION, response, system="Be brief.")
        assert tokenizer.decode(completion) == response + "</s>"
        assert "Be brief." in tokenizer.decode(prompt)
