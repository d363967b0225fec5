"""The tool-call and reasoning parsers on known calls: text written from known call objects
(json.dumps is the oracle) parses back to them, whole and fed in every two-piece split, and the
streamed argument fragments join to the whole call's arguments."""

from __future__ import annotations

import json

import pytest

from server.tooling.parser import ToolCallStream
from server.tooling.reasoning import ReasoningSplit

CALLS = [
    ("get_weather", {"city": 'Paris "centre" {x}', "unit": "celsius"}),
    ("lookup", {"word": "é😀", "n": [1, 2, {"k": None}]}),
]


def hermes(calls) -> str:
    return "\n".join(
        "<tool_call>\n" + json.dumps({"name": n, "arguments": a}) + "\n</tool_call>"
        for n, a in calls
    )


def llama3(calls) -> str:
    return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def mistral(calls) -> str:
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def run(fmt: str, text: str, pieces: list[str]):
    parser = ToolCallStream(fmt)
    content, fragments = "", {}
    for piece in pieces:
        c, deltas = parser.feed(piece)
        content += c
        for d in deltas:
            fragments[d["index"]] = fragments.get(d["index"], "") + d["function"]["arguments"]
    c, deltas = parser.finish()
    content += c
    for d in deltas:
        fragments[d["index"]] = fragments.get(d["index"], "") + d["function"]["arguments"]
    return content, parser.calls, fragments


@pytest.mark.parametrize(
    ("fmt", "write", "prefix"),
    [("hermes", hermes, "Let me check. "), ("llama3", llama3, ""), ("mistral", mistral, "")],
)
def test_calls_parse_back_whole_and_in_every_split(fmt, write, prefix):
    text = prefix + write(CALLS)
    for cut in range(len(text) + 1):
        content, calls, fragments = run(fmt, text, [text[:cut], text[cut:]])
        assert content == prefix
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            (n, a) for n, a in CALLS
        ]
        assert [fragments[i] for i in range(len(calls))] == [
            c["function"]["arguments"] for c in calls
        ]
        assert len({c["id"] for c in calls}) == len(calls)


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", "A <b>bold</b> reply with < and <tool but no call."),
        ("llama3", '{"not": "a call"} and text'),
        ("mistral", "[1] a reference"),
        ("hermes", "<tool_call>\nnot json\n</tool_call>"),
    ],
)
def test_text_without_calls_is_all_content(fmt, text):
    for cut in range(len(text) + 1):
        content, calls, _ = run(fmt, text, [text[:cut], text[cut:]])
        assert (content, calls) == (text, [])


def test_a_call_cut_off_keeps_its_arguments_so_far():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": "unfini'
    content, calls, fragments = run("hermes", text, [text])
    assert content == ""
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a": "unfini'}


@pytest.mark.parametrize(
    ("fmt", "text", "content", "names"),
    [
        ("hermes", hermes(CALLS[:1]) + '\n<tool_call>\n{"name":', "", ["get_weather"]),
        ("hermes", 'Checking. <tool_call>\n{"na', "Checking. ", []),
        ("llama3", llama3(CALLS[:1]) + '; {"name": "look', "", ["get_weather"]),
        ("mistral", mistral(CALLS[:1])[:-1] + ', {"name"', "", ["get_weather"]),
        ("llama3", '{"answer": "not a call, cut o', '{"answer": "not a call, cut o', []),
    ],
)
def test_a_call_cut_off_before_its_name_is_dropped(fmt, text, content, names):
    """max_tokens ending inside the next call's name: no `{"name":` left over as content (a bare
    JSON opening with no call before it is still content)."""
    for cut in range(len(text) + 1):
        got, calls, _ = run(fmt, text, [text[:cut], text[cut:]])
        assert (got, [c["function"]["name"] for c in calls]) == (content, names), cut


def test_keys_in_another_order_are_sent_whole_when_the_object_closes():
    text = hermes([]) + '<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>'
    content, calls, fragments = run("hermes", text, list(text))
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert fragments[0] == '{"a": 1}'


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "content"),
    [
        ("qwen3", "<think>\nweigh it</think>\n\nThe answer.", "\nweigh it", "The answer."),
        ("qwen3", "No thinking <think> here.", "", "No thinking <think> here."),
        ("deepseek_r1", "weigh it</think>The answer.", "weigh it", "The answer."),
        ("deepseek_r1", "<think>weigh</think>Answer", "weigh", "Answer"),
        ("deepseek_r1", "all reasoning, cut off", "all reasoning, cut off", ""),
    ],
)
def test_reasoning_split_in_every_split(parser, text, reasoning, content):
    for cut in range(len(text) + 1):
        split = ReasoningSplit(parser)
        r1, c1 = split.feed(text[:cut])
        r2, c2 = split.feed(text[cut:], final=True)
        assert (r1 + r2, c1 + c2) == (reasoning, content), cut
