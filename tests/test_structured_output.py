"""Structured output: grammar masks in the batched sampler, and the HTTP fields
that ask for them.

Every constrained output must parse and validate against its schema, greedy and sampled, while it
shares batches with unconstrained requests whose tokens stay exactly what they are alone. TinyGPT
has random weights, so the schemas here bound every string (a pattern, so no 6-byte \\u escapes),
number and array: its output can only finish because the grammar ends it.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
import torch

from engine import ContinuousBatchEngine, InvalidRequestError, Request, SamplingParams
from engine.structured import GrammarCompiler, StructuredSpec, allowed_tokens, closed_objects
from tests.helpers.engine_runs import mixed_specs, serve_individually
from tests.helpers.servers import run_server

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "admin"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"enum": ["tea", "cake", "soup"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "size": {"enum": ["S", "M", "L"]},
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "pattern": "^[a-z]{1,5}$"}]},
    },
    "required": ["items", "size", "note"],
    "additionalProperties": False,
}
SCHEMAS = [PERSON, ORDER]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # As the servers in these tests do: on 2 shared cores, two intra-op threads make TinyGPT's
    # small matmuls many times slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def compiler(tiny_lm) -> GrammarCompiler:
    return GrammarCompiler(tiny_lm.tokenizer)


def engine(lm, max_batch_size: int = 8) -> ContinuousBatchEngine:
    return ContinuousBatchEngine(lm.model, max_batch_size=max_batch_size, num_blocks=256)


def run_engine(engine, requests: list[Request]) -> dict[str, tuple[list[int], str | None]]:
    """Add all, step until done: request id -> (output ids, finish reason)."""
    out: dict[str, tuple[list[int], str | None]] = {r.request_id: ([], None) for r in requests}
    for r in requests:
        engine.add_request(r)
    for _ in range(10_000):
        if not engine.has_work():
            break
        for o in engine.step():
            out[o.request_id][0].extend(o.token_ids)
            if o.finished:
                out[o.request_id] = (out[o.request_id][0], o.finish_reason)
    assert not engine.has_work()
    return out


def test_constrained_rows_validate_and_unconstrained_neighbours_are_untouched(tiny_lm, compiler):
    free_specs = mixed_specs(n=4, seed=3, max_prompt=40, max_out=30)
    free_params = [
        SamplingParams(max_tokens=n)
        if i % 2 == 0
        else SamplingParams(max_tokens=n, temperature=0.9, top_p=0.95, seed=50 + i)
        for i, (_, n) in enumerate(free_specs)
    ]
    alone = serve_individually(tiny_lm.model, free_specs, lambda n, i: free_params[i])

    constrained: list[tuple[Request, dict]] = []
    prompts = mixed_specs(n=6, seed=4, max_prompt=30)
    for k, (prompt, _) in enumerate(prompts):
        schema = SCHEMAS[k % 2]
        params = (
            SamplingParams(max_tokens=200)
            if k < 3
            else SamplingParams(max_tokens=200, temperature=1.0, seed=k)
        )
        c = compiler.constraint(StructuredSpec.json_schema(schema))
        constrained.append((Request(prompt, params, constraint=c), schema))
    free = [Request(list(p), sp) for (p, _), sp in zip(free_specs, free_params, strict=True)]
    # Interleaved, and more requests than slots, so rows join and leave mid-way.
    mixed = [r for pair in zip(free, [r for r, _ in constrained], strict=False) for r in pair]
    mixed += [r for r, _ in constrained[len(free) :]]
    outputs = run_engine(engine(tiny_lm, max_batch_size=4), mixed)

    for r, schema in constrained:
        ids, reason = outputs[r.request_id]
        text = tiny_lm.tokenizer.decode(ids)
        jsonschema.validate(json.loads(text), schema)
        assert reason == "stop"  # the grammar ended it, not max_tokens
    assert [outputs[r.request_id][0] for r in free] == alone


def test_greedy_constrained_output_is_the_same_alone_and_batched(tiny_lm, compiler):
    spec = StructuredSpec.json_schema(PERSON)
    prompt = mixed_specs(n=1, seed=9, max_prompt=30)[0][0]

    def one() -> Request:
        return Request(prompt, SamplingParams(max_tokens=200), constraint=compiler.constraint(spec))

    alone = run_engine(engine(tiny_lm, max_batch_size=1), [r := one()])
    batched_req = one()
    others = [
        Request(p, SamplingParams(max_tokens=n))
        for p, n in mixed_specs(n=3, seed=10, max_prompt=30, max_out=20)
    ]
    batched = run_engine(engine(tiny_lm), [*others, batched_req])
    assert batched[batched_req.request_id] == alone[r.request_id]


def test_regex_choice_and_grammar_specs(tiny_lm, compiler):
    cases = [
        (StructuredSpec("regex", r"[A-Z]{2}-\d{3}"), lambda t: re.fullmatch(r"[A-Z]{2}-\d{3}", t)),
        (
            StructuredSpec("choice", json.dumps(["yes", "no", "maybe"])),
            lambda t: t in {"yes", "no", "maybe"},
        ),
        (
            StructuredSpec("grammar", 'start: "(" NUM ("+" NUM)? ")"\nNUM: /[0-9]{1,3}/'),
            lambda t: re.fullmatch(r"\(\d{1,3}(\+\d{1,3})?\)", t),
        ),
        (StructuredSpec("json_object"), None),
    ]
    requests = []
    for k, (spec, _) in enumerate(cases):
        params = SamplingParams(max_tokens=300, temperature=1.0, seed=k)
        requests.append(Request([65, 66, 67], params, constraint=compiler.constraint(spec)))
    outputs = run_engine(engine(tiny_lm), requests)
    for (spec, check), r in zip(cases, requests, strict=True):
        ids, reason = outputs[r.request_id]
        text = tiny_lm.tokenizer.decode(ids)
        if check is None:  # json_object: any object, which a random model may not close in time
            if reason == "stop":
                assert isinstance(json.loads(text), dict)
            else:
                assert text.startswith("{")
        else:
            assert check(text), (spec, text)
            assert reason == "stop"


@pytest.mark.parametrize(
    "spec, complaint",
    [
        (StructuredSpec("json_schema", json.dumps({"type": "strin"})), "strin"),
        (StructuredSpec("regex", "(abc", "guided_regex"), "unclosed group"),
        (StructuredSpec("grammar", "start: nothing_defined", "guided_grammar"), "nothing_defined"),
    ],
)
def test_invalid_specs_raise_naming_the_field(compiler, spec, complaint):
    with pytest.raises(InvalidRequestError, match=complaint) as e:
        compiler.constraint(spec)
    assert e.value.param == spec.param


def test_compiled_grammars_are_cached_and_each_constraint_has_its_own_state(compiler):
    spec = StructuredSpec.json_schema({"type": "object", "properties": {"q": {"type": "integer"}}})
    before = compiler.misses
    a, b = compiler.constraint(spec), compiler.constraint(spec)
    assert compiler.misses == before + 1 and compiler.hits >= 1
    assert a.accept(ord("{")) and not a.is_finished
    # b has not moved: it still wants "{" first.
    mask = torch.zeros(1, (260 + 31) // 32, dtype=torch.int32)
    b.fill_bitmask(mask, 0)
    assert allowed_tokens(mask, 260)[0].nonzero().flatten().tolist() == [ord("{")]


def test_objects_that_list_their_properties_allow_no_others_unless_they_say_so():
    nested = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "b": {"type": "array", "items": {"type": "object", "properties": {"y": {}}}},
            "c": {"anyOf": [{"type": "null"}, {"properties": {"z": {}}}]},
            "open": {"type": "object", "properties": {"w": {}}, "additionalProperties": True},
            "any": {"type": "object"},
            "both": {"allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}]},
        },
        "$defs": {"d": {"properties": {"v": {}}}},
    }
    before = json.dumps(nested)
    closed = closed_objects(nested)
    assert json.dumps(nested) == before  # the client's schema is not touched
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["a"]["additionalProperties"] is False
    assert props["b"]["items"]["additionalProperties"] is False
    assert props["c"]["anyOf"][1]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert "additionalProperties" not in props["any"]  # no properties listed: any object
    assert all("additionalProperties" not in m for m in props["both"]["allOf"])
    assert list(props) == ["a", "b", "c", "open", "any", "both"]  # generated in the client's order


def test_a_schema_nested_past_the_stack_is_a_request_error_not_a_crash():
    schema: dict = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(InvalidRequestError, match="nests too deeply"):
        StructuredSpec.json_schema(schema, "guided_json")


def test_a_compiled_schema_ends_the_object_after_its_properties(compiler):
    """The grammar itself (llguidance on TinyGPT's byte vocabulary): after the one listed
    property only "}" may follow; with additionalProperties true, "," may too."""

    def allowed_after(schema: dict, text: str) -> set[str]:
        c = compiler.constraint(StructuredSpec.json_schema(schema))
        for ch in text:
            assert c.accept(ord(ch)), text
        mask = torch.zeros(1, (260 + 31) // 32, dtype=torch.int32)
        c.fill_bitmask(mask, 0)
        ids = allowed_tokens(mask, 260)[0].nonzero().flatten().tolist()
        return {chr(i) for i in ids if i < 256}

    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    assert allowed_after(schema, '{"a": true') == {"}"}
    assert "," in allowed_after({**schema, "additionalProperties": True}, '{"a": true')


def test_the_tokenizer_trie_is_built_in_the_background_and_a_first_request_waits(
    tiny_lm, monkeypatch
):
    import threading

    import engine.structured as structured

    release, calls = threading.Event(), []
    real = structured._ll_tokenizer

    def slow(tokenizer, vocab_size):
        calls.append(threading.current_thread().name)
        release.wait(10)
        return real(tokenizer, vocab_size)

    monkeypatch.setattr(structured, "_ll_tokenizer", slow)
    compiler = GrammarCompiler(tiny_lm.tokenizer)
    builder = compiler.prepare()
    assert builder.is_alive() and compiler.prepare() is builder  # started once, not waited for
    got = []
    request = threading.Thread(
        target=lambda: got.append(compiler.constraint(StructuredSpec("json_object")))
    )
    request.start()
    request.join(0.3)
    assert request.is_alive() and not got  # the first request waits for the build...
    release.set()
    request.join(10)
    builder.join(10)
    assert len(got) == 1 and calls == ["grammar-tokenizer"]  # ...which ran once, in the background
    mask = torch.zeros(1, (260 + 31) // 32, dtype=torch.int32)
    got[0].fill_bitmask(mask, 0)
    assert allowed_tokens(mask, 260)[0].nonzero().flatten().tolist() == [ord("{")]


def test_a_sentencepiece_vocabulary_constrains_by_its_pieces(tmp_path):
    """Gemma's tokenizer (models.spm_tokenizer) gives llguidance each piece's bytes: a regex
    allows the pieces that start a match (whole words, single letters, byte tokens), no others."""
    from models.spm_tokenizer import load_spm_tokenizer
    from tests.helpers.model_files import write_gemma_vocab_gguf

    tok = load_spm_tokenizer(write_gemma_vocab_gguf(tmp_path / "v.gguf"))
    compiler = GrammarCompiler(tok)
    compiler.prepare().join(30)
    c = compiler.constraint(StructuredSpec("regex", "h[a-z]+ world"))
    mask = torch.zeros(1, (tok.vocab_size + 31) // 32, dtype=torch.int32)
    c.fill_bitmask(mask, 0)
    allowed = set(allowed_tokens(mask, tok.vocab_size)[0].nonzero().flatten().tolist())
    starts = {i for i in range(tok.vocab_size) if re.fullmatch(rb"h[a-z]*", tok.token_bytes(i))}
    assert allowed == starts and {"h", "hello", "<0x68>"} <= {tok._tokens[i] for i in starts}
    for i in tok.encode("hello world"):
        assert c.accept(i)
    assert c.is_finished


def test_a_grammar_names_a_special_token_by_its_text(tmp_path):
    """llguidance knows a special token by its text (`<end_of_turn>`), as a Lark grammar writes
    it: after "yes" the mask allows that token alone."""
    from models.spm_tokenizer import load_spm_tokenizer
    from tests.helpers.model_files import write_gemma_vocab_gguf

    tok = load_spm_tokenizer(write_gemma_vocab_gguf(tmp_path / "v.gguf"))
    compiler = GrammarCompiler(tok)
    c = compiler.constraint(StructuredSpec("grammar", 'start: "yes" <end_of_turn>'))
    for i in tok.encode("yes"):
        assert c.accept(i)
    mask = torch.zeros(1, (tok.vocab_size + 31) // 32, dtype=torch.int32)
    c.fill_bitmask(mask, 0)
    (end,) = tok.encode("<end_of_turn>")
    assert allowed_tokens(mask, tok.vocab_size)[0].nonzero().flatten().tolist() == [end]
    assert c.accept(end) and c.is_finished


def test_allowed_tokens_unpacks_bits_and_pads_the_vocabulary():
    bits = torch.tensor([[0b101, -(2**31)]], dtype=torch.int32)  # tokens 0, 2 and 63
    allowed = allowed_tokens(bits, 70)
    assert allowed.shape == (1, 70)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, 63]


# -- over HTTP --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tiny_lm):
    with run_server(tiny_lm) as server:
        yield server


@pytest.fixture(scope="module")
def sdk(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


@pytest.mark.slow
def test_http_response_format_on_both_endpoints_streamed_and_not(live, sdk, tiny_lm):
    messages = [{"role": "user", "content": "A person, please."}]
    chat = sdk.chat.completions.create(
        model=tiny_lm.name,
        messages=messages,
        response_format=schema_format(PERSON),
        max_tokens=200,
        n=3,
        temperature=1.0,
        seed=1,
    )
    for choice in chat.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        assert choice.finish_reason == "stop"
    stream = sdk.completions.create(
        model=tiny_lm.name,
        prompt="An order: ",
        max_tokens=200,
        stream=True,
        extra_body={"response_format": schema_format(ORDER)},
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    jsonschema.validate(json.loads(text), ORDER)
    done = sdk.completions.create(
        model=tiny_lm.name,
        prompt="Yes or no? ",
        max_tokens=20,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert done.choices[0].text in ("yes", "no")
    regex = sdk.chat.completions.create(
        model=tiny_lm.name,
        messages=messages,
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": r"[0-9]{4}"}},
    )
    assert re.fullmatch(r"[0-9]{4}", regex.choices[0].message.content)


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {
                "response_format": schema_format(
                    {"type": "object", "properties": {"a": {"type": 5}}}
                )
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, None),
        ({"response_format": {"type": "xml"}}, None),
        ({"guided_regex": "a{"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, None),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs"),
    ],
)
def test_http_bad_structured_output_requests_are_400(live, fields, param):
    body = {"prompt": "x", "max_tokens": 4, **fields}
    r = httpx.post(live.url("/v1/completions"), json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    # The server is fine afterwards.
    assert (
        httpx.post(live.url("/v1/completions"), json={"prompt": "x", "max_tokens": 2}).status_code
        == 200
    )


@pytest.mark.slow
def test_smollm2_json_schema_outputs_validate_greedy_and_sampled(smollm2_lm):
    """The real model: extraction into a schema, greedy and sampled (n=3), both endpoints."""
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "country": {"type": "string", "maxLength": 30},
            "population_millions": {"type": "number", "minimum": 0, "maximum": 100},
        },
        "required": ["city", "country", "population_millions"],
        "additionalProperties": False,
    }
    messages = [
        {
            "role": "user",
            "content": "Paris is the capital of France and has 2.1 million people. "
            "Give the city, country and population as JSON.",
        }
    ]
    with run_server(smollm2_lm, engine_options={"kv_cache_memory_gib": 0.1}) as server:
        client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        greedy = client.chat.completions.create(
            model=smollm2_lm.name,
            messages=messages,
            response_format=schema_format(schema),
            max_tokens=80,
            temperature=0,
        )
        sampled = client.chat.completions.create(
            model=smollm2_lm.name,
            messages=messages,
            response_format=schema_format(schema),
            max_tokens=80,
            n=3,
        )
        anything = client.chat.completions.create(
            model=smollm2_lm.name,
            messages=messages,
            response_format={"type": "json_object"},
            max_tokens=80,
            temperature=0,
        )
    for choice in [*greedy.choices, *sampled.choices]:
        value = json.loads(choice.message.content)
        jsonschema.validate(value, schema)
        assert choice.finish_reason == "stop"
    assert json.loads(greedy.choices[0].message.content)["city"] == "Paris"
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_a_grammar_that_reaches_a_dead_end_ends_its_request_with_an_error_not_stop(
    tiny_lm, compiler
):
    """'x' is allowed first, then nothing can complete the grammar: the engine ends the request
    with finish_reason "error" and the reason, not as a normal stop."""
    dead_end = compiler.constraint(StructuredSpec("grammar", 'start: "x" b\nb: b "y"'))
    fine = compiler.constraint(StructuredSpec("regex", "ab"))
    requests = [
        Request([1, 2, 3], SamplingParams(max_tokens=8), constraint=dead_end),
        Request([1, 2, 3], SamplingParams(max_tokens=8), constraint=fine),
    ]
    eng = engine(tiny_lm)
    for r in requests:
        eng.add_request(r)
    last = {}
    while eng.has_work():
        for o in eng.step():
            if o.finished:
                last[o.request_id] = o
    bad, good = (last[r.request_id] for r in requests)
    assert bad.finish_reason == "error" and "no further output" in bad.error
    assert good.finish_reason == "stop" and good.error is None
