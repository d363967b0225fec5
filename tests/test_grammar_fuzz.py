"""Property-based fuzzing of what the server compiles for clients (hypothesis): random JSON
Schemas, regexes, Lark and GBNF grammars and choice lists, plausible and hostile ($ref chains
thousands long, deep nesting, recursive roots, regex intersections that explode, huge enums,
nested quantifiers), sent as response_format, guided_* fields and tool parameters to a real
server (TinyGPT on loopback, a 2 s check budget).

The properties: the server never dies, never answers 5xx or cuts a connection; every refusal
is an OpenAI-shaped 400 with a structured-output or tools code and no library internals in its
message; every JSON output that ends normally parses and validates against its schema
(`jsonschema`, an implementation independent of llguidance); and the server still answers
/health after each example.

Derandomized and small in CI (a few tens of seconds). For a longer run, outside CI:
`GRAMMAR_FUZZ_EXAMPLES=4000 GRAMMAR_FUZZ_SECONDS=600 HYPOTHESIS_SEED=random
GRAMMAR_FUZZ_REPORT=out.json pytest tests/test_grammar_fuzz.py --timeout 1500` (examples past
the time are skipped; the report counts what was tried and how it ended, and the server
process's memory).
"""

from __future__ import annotations

import json
import os
import string
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.grammars.check_worker import CheckBudget
from server.http.app import ServerSettings
from tests.helpers.servers import LiveServer, run_server

EXAMPLES = int(os.environ.get("GRAMMAR_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("HYPOTHESIS_SEED") != "random",
    database=None,
    suppress_health_check=list(HealthCheck),
)
REPORT = os.environ.get("GRAMMAR_FUZZ_REPORT")
SECONDS = float(os.environ.get("GRAMMAR_FUZZ_SECONDS", "inf"))
SETTINGS = ServerSettings(grammar_budget=CheckBudget(seconds=2.0, memory_mib=512))
# (tools are described in the prompt in generic mode: a huge schema can overflow the context)
CODES = {"invalid_structured_output", "invalid_tools", "context_length_exceeded"}
INTERNALS = ("panic", "backtrace", "<unknown>", ".rs:", "Traceback")

# -- JSON Schemas ------------------------------------------------------------------------------------

names = st.text(string.ascii_lowercase, min_size=1, max_size=4)
small = st.integers(0, 4)

# Regexes: a small grammar of ECMA/Rust-compatible constructs, nested quantifiers included.
regex_atoms = st.sampled_from(["a", "b", "[a-c]", "[^x]", ".", "\\d", "x|y", "(ab)"])
regexes = st.recursive(
    regex_atoms,
    lambda inner: st.one_of(
        st.tuples(inner, inner).map("".join),
        st.tuples(inner, st.sampled_from(["*", "+", "?", "{2}", "{0,3}", "{1,40}", "{3,}"])).map(
            lambda p: f"({p[0]}){p[1]}"
        ),
        st.tuples(inner, inner).map(lambda p: f"({p[0]}|{p[1]})"),
    ),
    max_leaves=6,
)

leaf_schemas = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda r: {"type": "string", "pattern": f"^{r}$"}, regexes),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-5, 5),
        small,
    ),
    st.just({"type": "number", "minimum": 0, "maximum": 1}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda vs: {"enum": vs}, st.lists(names, min_size=1, max_size=4, unique=True)),
    st.builds(lambda v: {"const": v}, names | st.integers(-3, 3)),
    st.sampled_from([{"type": "string", "format": f} for f in ("date", "uuid", "email")]),
    st.just(True),
)


def _object(props: dict, required: list[str], extra) -> dict:
    schema = {
        "type": "object",
        "properties": props,
        "required": [r for r in dict.fromkeys(required) if r in props],
    }
    if extra is not None:
        schema["additionalProperties"] = extra
    return schema


schemas = st.recursive(
    leaf_schemas,
    lambda inner: st.one_of(
        st.builds(
            _object,
            st.dictionaries(names, inner, max_size=3),
            st.lists(names, max_size=3),
            st.none() | st.just(False),
        ),
        st.builds(
            lambda items, lo, extra: {
                "type": "array",
                "items": items,
                "minItems": lo,
                "maxItems": lo + extra,
            },
            inner,
            st.integers(0, 2),
            st.integers(0, 2),
        ),
        st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda xs: {"oneOf": xs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda xs: {"allOf": xs}, st.lists(inner, min_size=1, max_size=2)),
    ),
    max_leaves=10,
)


def ref_chain(target: dict, n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = target
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested(target: dict, depth: int) -> dict:
    for _ in range(depth):
        target = {"type": "object", "properties": {"x": target}, "required": ["x"]}
    return target


def recursive_root(target: dict) -> dict:
    return {
        "type": "object",
        "properties": {"v": target, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["v"],
    }


def intersected_patterns(k: int) -> dict:
    return {"type": "string", "allOf": [{"pattern": f"^(.*c.*){{{i}}}$"} for i in range(1, k + 1)]}


# The hostile shapes, each around an ordinary schema.
hostile_schemas = st.one_of(
    st.builds(ref_chain, schemas, st.sampled_from([1, 5, 100, 1000, 2500, 4000, 8000])),
    st.builds(nested, schemas, st.sampled_from([3, 20, 60, 127, 129, 400])),
    st.builds(recursive_root, schemas),
    st.builds(intersected_patterns, st.integers(1, 30)),
    st.builds(lambda n: {"enum": [f"v{i}" for i in range(n)]}, st.sampled_from([10, 3000, 20000])),
)
any_schemas = st.one_of(schemas, schemas.map(lambda s: nested(s, 1)), hostile_schemas)

# -- grammars ----------------------------------------------------------------------------------------


def lark_chain(n: int, recursive: bool) -> str:
    rules = [f"r{i}: r{i + 1}" + (f' | "{i % 10}" r{i}' if recursive else "") for i in range(n)]
    return "start: r0\n" + "\n".join(rules) + f'\nr{n}: "z"'


lark_bodies = st.lists(
    st.sampled_from(['"a"', '"b" start', "T", "start start", '"("start")"', '""', "/[0-9]+/"]),
    min_size=1,
    max_size=3,
).map(lambda alts: "start: " + " | ".join(alts) + '\nT: "t"')
grammars = st.one_of(
    lark_bodies,
    st.builds(lark_chain, st.sampled_from([2, 50, 1000, 3000, 6000]), st.booleans()),
    st.builds(lambda r: f"root ::= [a-c] {r!r}".replace("'", '"'), names),  # GBNF
    st.sampled_from(["start: a\na: a", 'start: "x" b\nb: b "y"', "start: /a{1,100}{1,100}/"]),
)

# -- requests ----------------------------------------------------------------------------------------


def body_of(kind: str, value) -> dict:
    base = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24, "temperature": 0}
    if kind == "response_format":
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": value}}
        return {**base, "response_format": rf}
    if kind == "tool_parameters":
        params = value
        if not isinstance(value, dict) or value.get("type") != "object":
            # wrapped as one property, its $defs moved to the root its refs name
            inner = {k: v for k, v in value.items() if k != "$defs"} if value is not True else {}
            params = _object({"p": inner}, ["p"], None)
            if isinstance(value, dict) and "$defs" in value:
                params["$defs"] = value["$defs"]
        tool = {"type": "function", "function": {"name": "f", "parameters": params}}
        return {**base, "tools": [tool], "tool_choice": "required", "max_tokens": 48}
    return {**base, kind: value}


requests = st.one_of(
    st.tuples(st.sampled_from(["response_format", "guided_json", "tool_parameters"]), any_schemas),
    st.tuples(st.just("guided_regex"), regexes),
    st.tuples(st.just("guided_grammar"), grammars),
    st.tuples(
        st.just("guided_choice"),
        st.lists(names, min_size=1, max_size=5)
        | st.sampled_from([[f"c{i}" for i in range(30000)]]),
    ),
)


@pytest.fixture(scope="module")
def live(tiny_lm) -> Iterator[LiveServer]:
    with run_server(tiny_lm, settings=SETTINGS) as server:
        yield server


def valid_schema(schema) -> bool:
    """A schema the oracle can judge by (the server may accept what the meta-schema does not)."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError:
        return False
    return True


TRIED: Counter = Counter()
RUN = {"started": time.monotonic(), "rss_start_mb": None, "slowest_s": 0.0}


def rss_mb() -> int:
    """This process's resident memory: the server under test runs in it."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


@FUZZ
@given(case=requests)
def test_fuzzed_grammars_never_crash_5xx_or_leak_internals(live, case):
    if RUN["rss_start_mb"] is None:
        RUN["rss_start_mb"] = rss_mb()
    if time.monotonic() - RUN["started"] > SECONDS:
        return  # the long run's time is up
    kind, value = case
    body = body_of(kind, value)
    sent = time.monotonic()
    r = httpx.post(live.url("/v1/chat/completions"), json=body, timeout=60)
    RUN["slowest_s"] = max(RUN["slowest_s"], time.monotonic() - sent)
    TRIED[(kind, r.status_code)] += 1
    assert r.status_code in (200, 400), r.text[:500]
    payload = r.json()
    if r.status_code == 400:
        err = payload["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] in CODES, err
        assert not any(w in err["message"] for w in INTERNALS), err["message"]
        TRIED[("refused", err["message"][:60])] += 1
    else:
        choice = payload["choices"][0]
        TRIED[(kind, "finish", choice["finish_reason"])] += 1
        schema = body.get("guided_json") or (value if kind == "response_format" else None)
        if schema is not None and choice["finish_reason"] == "stop" and valid_schema(schema):
            # The oracle: an independent validator (formats are annotations to it, as JSON
            # Schema says; llguidance enforces them, which only narrows the output).
            try:
                jsonschema.validate(json.loads(choice["message"]["content"]), schema)
            except RecursionError:  # the oracle cannot follow a $ref chain this long
                TRIED[("oracle", "too deep to judge")] += 1
    assert httpx.get(live.url("/health"), timeout=10).status_code == 200


def teardown_module() -> None:
    if REPORT:
        rows = [
            {"what": list(map(str, key)), "count": n} for key, n in sorted(TRIED.items(), key=str)
        ]
        tried = sum(n for key, n in TRIED.items() if isinstance(key[1], int))
        summary = {
            "requests": tried,
            "seconds": round(time.monotonic() - RUN["started"]),
            "slowest_request_s": round(RUN["slowest_s"], 2),
            "rss_start_mb": RUN["rss_start_mb"],
            "rss_end_mb": rss_mb(),
        }
        with open(REPORT, "w") as f:
            json.dump({**summary, "outcomes": rows}, f, indent=1)
