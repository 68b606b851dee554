"""The content rules case by case: what each must flag (with the span it must underline), what
it must leave alone, and a false-alarm corpus of ordinary text that no rule may flag."""

from __future__ import annotations

import pytest

from prefixcache.sdk import Finding, Prompt, Segment, lint


def _findings(text: str, stability: str = "static") -> list[Finding]:
    role = "system" if stability == "static" else "user"
    return lint(Prompt([Segment(role, text, "seg", stability)]))  # type: ignore[arg-type]


def _flagged(rule: str, text: str, stability: str = "static") -> list[str]:
    """The texts under the spans of ``rule``'s finding ([] when it did not fire)."""
    for f in _findings(text, stability):
        if f.rule == rule:
            assert f.span == f.spans[0] and all(0 <= s < e <= len(text) for s, e in f.spans)
            assert f.spans == tuple(sorted(f.spans))
            return [text[s:e] for s, e in f.spans]
    return []


# Ordinary prompt text: prose, code, version numbers, prices, product codes, numbers. No rule
# may flag any of it, even in a static segment, where the rules are strictest.
FALSE_ALARMS = [
    # prose
    "You are a careful support assistant. Answer from the documents and say when they do not "
    "cover the question.",
    "Refunds go back to the original payment method within 5 business days.",
    "Opening hours are 9:00 to 17:00 on weekdays; on Saturdays 10am-2pm.",
    "Backups run at 02:00 daily and the report is mailed each morning.",
    "The policy was first published in 2019 and revised twice since.",
    "Every request is answered politely; trace the cause of errors before replying.",
    "Ask for the request ID when a user reports a bug.",
    "The user is asked to confirm before any change. Customer: the person who buys.",
    "User: How do I reset my password?\nAssistant: Use the reset link.\nUser: Thanks.",
    "Send questions to support@acme.example or billing@acme.example.",
    "Retry up to 3 times before giving up; wait 30 seconds before a retry.",
    "Step 2: check the answer. Take turns. At most 20 turns per conversation.",
    "Chapter 3 covers retries. Round 2 decimal places. Call 911 in an emergency.",
    "Messages older than 30 days are deleted; the counter resets nightly.",
    "Use a random sample of the documents. Salt: a pinch. Nonce words are made up.",
    "The team won 2:1, set the aspect ratio to 16:9, and see John 3:16.",
    "It was a long time ago, in a galaxy far away.",
    'Answer as JSON, e.g. {"answer": "...", "sources": []}, without prose around it.',
    # code
    "def get_user(user_id: int) -> User:\n    return db.users[user_id]",
    "Use getUserById2FromCache and MAX_RETRY_COUNT_2_VALUE; see src/App/v2/UserProfile3Page.tsx.",
    "for (let i = 0; i < 10; i++) { total += prices[i]; }",
    "Call the run() method of the requests library with timeout=30.",
    "SELECT id, name FROM orders WHERE created_at > :since ORDER BY id LIMIT 20;",
    "Connect to localhost:8000 or port 8080; the base URL ends in /v1.",
    "See https://example.com/docs/getting-started/v2/Install for the guide.",
    "commit 3f2a9c1 fixed the bug; SHA-256 and base64 encodings are supported.",
    # versions
    "Python 3.12 and Node 20.11.1 are supported; tag v1.2.3-rc.1 is the release candidate.",
    "Models: Llama-3.1-8B-Instruct, Qwen2.5-Coder-32B-Instruct, gpt-4o-mini-2024-07-18.",
    "Version 10.4.1234.5678 of the driver, schema 2024.11 and API v2.",
    # prices
    "Prices: $12.50, €9.99, 1,299.00 USD, and £0.99 per month.",
    "Report totals in euros with two decimals, e.g. 12.50.",
    # product codes (some phone-shaped)
    "Product codes: SKU-A17-BLK-XL-2024, ABC123DEF456GHI, part 415-555-0132-B.",
    "ISBN 978-3-16-148410-0 and 1-800-FLOWERS are well known.",
    "Order item 555-0132 ships from warehouse 7.",
    # ordinary numbers
    "The value 1764410142 appears in the id column; order_id=1764410142.",
    "Population 8,336,817; area 783.8 km²; 42 is the answer.",
    "Use 4 spaces for indentation and lines of at most 100 characters.",
]


@pytest.mark.parametrize("text", FALSE_ALARMS)
def test_false_alarm_corpus_is_quiet(text: str) -> None:
    assert _findings(text) == []
    assert _findings(text, "shared") == []


CLOCK = [
    ("It is now 14:05 and the office is open.", "static", "It is now 14:05"),
    ("It's 2:05 pm in London.", "static", "It's 2:05 pm"),
    ("Local time 14:05 CET.", "static", "time 14:05 CET"),
    ("The meeting is at 14:30.", "static", "at 14:30"),
    ("Call back at 11pm EST.", "static", "11pm EST"),
    ("The report was generated at 09:12:44.", "shared", "09:12:44"),
    ("Last sync: 2026-11-29T10:15:00+01:00", "shared", "2026-11-29T10:15:00+01:00"),
    ("record id=77 ts=1764410142 status=ok", "shared", "ts=1764410142"),
    ('{"generated_at":1764410142000,"status":"ok"}', "shared", '"generated_at":1764410142000'),
    ("timestamp 1764410142", "session", "timestamp 1764410142"),
    ("Today is Sunday, November 29.", "session", "Today is Sunday, November 29"),
    ("Date: 11/29/2026", "static", "11/29/2026"),
    ("Datum: 29.11.2026", "static", "29.11.2026"),
    ("Current date: 2026-11-29.", "static", "Current date"),
    ("Meeting on 29 November 2026.", "static", "29 November 2026"),
    ("The 29th of November 2026 is the launch.", "static", "29th of November 2026"),
    ("Updated 3 minutes ago.", "shared", "3 minutes ago"),
    ("Posted an hour ago by the editor.", "shared", "an hour ago"),
]


@pytest.mark.parametrize(("text", "stability", "value"), CLOCK)
def test_pc001_flags_clock_values(text: str, stability: str, value: str) -> None:
    assert _flagged("PC001", text, stability)[0] == value


@pytest.mark.parametrize(
    ("text", "stability"),
    [
        ("Opening hours are 9:00 to 17:00 on weekdays.", "static"),
        ("Backups run at 02:00 daily.", "static"),
        ("Set the aspect ratio to 16:9.", "static"),
        ("Python 3.12 and Node 20.11.1.", "static"),
        ("The value 1764410142 appears in the id column.", "shared"),
        ("order_id=1764410142", "shared"),
        ("ts=12345", "shared"),  # not a plausible Unix time
        ("Policy effective 1 March 2024.", "shared"),  # a date in a document is content
        ("Meet at 14:30.", "session"),  # history is written once
        ("Refunds within 30 days; wait 5 minutes.", "static"),
        ("It is now 14:05.", "dynamic"),
        ("Version 2024.11.29 of the schema.", "static"),
    ],
)
def test_pc001_leaves_alone(text: str, stability: str) -> None:
    assert _flagged("PC001", text, stability) == []


RANDOM_IDS = [
    (
        "Session 550E8400-E29B-41D4-A716-446655440000 started.",
        "550E8400-E29B-41D4-A716-446655440000",
    ),
    ("v7 id 01932c07-a8b4-7f3e-9c1a-2b3c4d5e6f70", "01932c07-a8b4-7f3e-9c1a-2b3c4d5e6f70"),
    ("Key 01ARZ3NDEKTSV4RRFFQ69G5FAV here.", "01ARZ3NDEKTSV4RRFFQ69G5FAV"),
    ("KSUID 0ujtsYcgvSTl8PAuAdqWYSMnLOv", "0ujtsYcgvSTl8PAuAdqWYSMnLOv"),
    ("id V1StGXR8_Z5jdHi6B-myT", "V1StGXR8_Z5jdHi6B-myT"),
    (
        "Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0",
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0",
    ),
    ("digest d41d8cd98f00b204e9800998ecf8427e", "d41d8cd98f00b204e9800998ecf8427e"),
    ("token: Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MA==", "token: Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MA=="),
    ("api_key=sk-proj-4f9Xk2LmQ8rT1vZ7", "api_key=sk-proj-4f9Xk2LmQ8rT1vZ7"),
    ("cache_buster=83726451", "cache_buster=83726451"),
    ("nonce=k3j5h2l6m8n9p0q1r2s3", "nonce=k3j5h2l6m8n9p0q1r2s3"),
    ("data blob aGVsbG8gd29ybGQgMTIzNDU2Nzg5", "aGVsbG8gd29ybGQgMTIzNDU2Nzg5"),
]


@pytest.mark.parametrize(("text", "value"), RANDOM_IDS)
def test_pc002_flags_random_ids(text: str, value: str) -> None:
    assert _flagged("PC002", text)[0] == value
    assert _flagged("PC002", text, "shared")[0] == value


@pytest.mark.parametrize(
    "text",
    [
        "Use getUserById2FromCache to look users up.",
        "Models: Llama-3.1-8B-Instruct and Qwen2.5-Coder-32B-Instruct.",
        "The internationalization module handles text.",
        "user_profile_v2_cache_key and MAX_RETRY_COUNT_2_VALUE are constants.",
        "SKU-A17-BLK-XL-2024 and ABC123DEF456GHI are product codes.",
        "commit 3f2a9c1 fixed it; tag v1.2.3-rc.1.",
        "The salt: a pinch. The session ends politely.",
        "See https://example.com/docs/getting-started/v2/Install.",
        "Hash with SHA-256; encode with base64.",
        "A random sample of 10 documents.",
        "nonce: 8c1f2a",  # dynamic: anything goes
    ],
)
def test_pc002_leaves_alone(text: str) -> None:
    stability = "dynamic" if text.startswith("nonce") else "static"
    assert _flagged("PC002", text, stability) == []


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("request_id=req-83hd72", "request_id=req-83hd72"),
        ("x-amz-request-id: 4442587FB7D0A2F9", "x-amz-request-id: 4442587FB7D0A2F9"),
        ("Root=1-5759e988-bd862e3fe1be46a994272793", "Root=1-5759e988-bd862e3fe1be46a994272793"),
        ("trace 105445aa7843bc8bf206b12000100000/1;o=1", "105445aa7843bc8bf206b12000100000/1;o=1"),
        ("ray 8c1f2a3b4c5d6e7f-SJC", "8c1f2a3b4c5d6e7f-SJC"),
        ("Anthropic request req_011CV3kPn8RfWqz9", "req_011CV3kPn8RfWqz9"),
        ("OpenAI response chatcmpl-9x8Yz7W6v5U4t3S2", "chatcmpl-9x8Yz7W6v5U4t3S2"),
        ("span_id: 00f067aa0ba902b7", "span_id: 00f067aa0ba902b7"),
        ("Run ID: run_7f3e9c1a2b", "Run ID: run_7f3e9c1a2b"),
        ("correlation id 83hd72", "correlation id 83hd72"),
    ],
)
def test_pc003_flags_request_ids_once(text: str, value: str) -> None:
    assert _flagged("PC003", text, "shared")[0] == value
    assert _flagged("PC002", text, "shared") == []  # one finding for one id


@pytest.mark.parametrize(
    "text",
    [
        "Every request is answered politely.",
        "Ask for the request ID when a user reports a bug.",
        "The span of control is small.",
        "Use the requests library; call the run() method.",
        "A correlation between price and demand.",
        "See the message_id field in the docs.",
        "req_ prefixed ids are logged by the server.",
        "Trace the cause of errors.",
        "Each transaction is atomic.",
        "Invocation of a tool costs one call.",
    ],
)
def test_pc003_leaves_alone(text: str) -> None:
    assert _flagged("PC003", text) == []


USER_DATA = [
    ("The user's email is jane.doe@example.com.", "jane.doe@example.com"),
    ("Call the customer at +1 415 555 0132.", "+1 415 555 0132"),
    ("Phone: 415-555-0132", "415-555-0132"),
    ("Mobile (0171) 555 0132", "(0171) 555 0132"),
    ("You can reach them at (415) 555-0132.", "(415) 555-0132"),
    ("User: jdoe42", "jdoe42"),
    ("Customer: Maria Lopez", "Maria Lopez"),
    ("Logged in as @maria_l", "Logged in as @maria_l"),
    ("Account number: 12345678", "Account number: 12345678"),
    ("Card ending in 4242.", "Card ending in 4242"),
    ("IBAN DE89 3704 0044 0532 0130 00", "DE89 3704 0044 0532 0130 00"),
    ("Card 4111 1111 1111 1111 on file.", "4111 1111 1111 1111"),
    ("user_id=8812", "user_id=8812"),
    ("You are talking to Maria, a premium member.", "You are talking to M"),
]


@pytest.mark.parametrize(("text", "value"), USER_DATA)
def test_pc007_flags_user_data_in_static(text: str, value: str) -> None:
    assert _flagged("PC007", text)[0] == value
    assert _flagged("PC007", text, "session") == []  # per-user data belongs there


@pytest.mark.parametrize(
    "text",
    [
        "User: How do I reset my password?",
        "User: Thanks.",
        "Send questions to support@acme.example; users may log in.",
        "Product codes: 415-555-0132-B and part 555-0132.",
        "Call the search tool with the order id.",
        "The user is asked to confirm.",
        "Customer: the person who buys.",
        "Our office phone line opens at 9.",
        "Card 4111 1111 1111 1112 is a test pattern.",  # fails the Luhn check
        "Contact the member services team.",
        "Use @decorator syntax; ask users: be kind.",
    ],
)
def test_pc007_leaves_alone(text: str) -> None:
    assert _flagged("PC007", text) == []


@pytest.mark.parametrize(
    ("text", "stability", "value"),
    [
        ("This is turn 5 of the chat.", "static", "turn 5"),
        ("Attempt 2: be more careful.", "static", "Attempt 2"),
        ("3 retries left", "static", "3 retries left"),
        ("2nd attempt", "static", "2nd attempt"),
        ("You have 12 credits remaining.", "shared", "12 credits remaining"),
        ("Message #14 in this thread.", "static", "Message #14"),
        ("Tokens used: 1234", "shared", "Tokens used: 1234"),
        ("visit number 7", "static", "visit number 7"),
        ("seq=42", "shared", "seq=42"),
        ("Question 4 of 10.", "static", "Question 4 of 10"),
        ("call count: 5", "shared", "call count: 5"),
        ("Round 3 of 5 begins.", "static", "Round 3 of 5"),
    ],
)
def test_pc008_flags_counters(text: str, stability: str, value: str) -> None:
    assert _flagged("PC008", text, stability)[0] == value


@pytest.mark.parametrize(
    ("text", "stability"),
    [
        ("Retry 3 times at most.", "static"),
        ("Step 2: check the answer. Take turns.", "static"),
        ("Chapter 3 covers retries; see Python 3.12 and version 3.", "static"),
        ("At most 20 turns per conversation.", "static"),
        ("Use exponential backoff, up to 5 retries.", "static"),
        ("Wait 30 seconds before retry.", "static"),
        ("The request body is JSON; each message has a role.", "static"),
        ("Call 911 in an emergency.", "static"),
        ("Round 2 decimal places.", "static"),
        ("A try/except block; count the words.", "static"),
        ("This is turn 5 of the chat.", "session"),  # history may count
        ("This is turn 5 of the chat.", "dynamic"),
    ],
)
def test_pc008_leaves_alone(text: str, stability: str) -> None:
    assert _flagged("PC008", text, stability) == []


@pytest.mark.parametrize(
    ("text", "value", "why"),
    [
        ('{"b": 1, "a": 2}', '{"b": 1, "a": 2}', "keys not in sorted order"),
        ('{"a": {"z": 1, "y": 2}}', '{"a": {"z": 1, "y": 2}}', "keys not in sorted order"),
        ("[1, 2, 3]", "[1, 2, 3]", "spacing"),
        ('{\n  "a": 1,\n  "b": 2\n}', '{\n  "a": 1,\n  "b": 2\n}', "spacing"),
        ('{"a":1,"b":2.50}', '{"a":1,"b":2.50}', "number format"),
        ('{"a":1e3}', '{"a":1e3}', "number format"),
        ('{"a":"caf\\u00e9","b":1}', '{"a":"caf\\u00e9","b":1}', "escapes"),
        (
            'Name: {"city":"K\\u00f6ln","zip":"50667"} ok',
            '{"city":"K\\u00f6ln","zip":"50667"}',
            "escapes",
        ),
        ('{"score":0.30000000000000004}', '{"score":0.30000000000000004}', "machine precision"),
        ('Weights: {"w": 0.12345678901234} today', '{"w": 0.12345678901234}', "machine precision"),
        ('Config:\n```json\n{"b":1,"a":2}\n```\nUse it.', '{"b":1,"a":2}', "sorted"),
    ],
)
def test_pc004_flags_unstable_json(text: str, value: str, why: str) -> None:
    assert _flagged("PC004", text, "shared") == [value]
    (finding,) = [f for f in _findings(text, "shared") if f.rule == "PC004"]
    assert why in finding.message


@pytest.mark.parametrize(
    "text",
    [
        '{"a":2,"b":1}',
        '{"a":1,"b":[1,2],"c":{"d":null,"e":true}}',
        '{"price":12.5,"sku":"A-17"}',
        '{"city":"Köln"}',
        "[citation needed] is not JSON",
        "See [1, 2] for details.",  # a citation, not data
        'Answer as {"answer": "...", "sources": []}.',  # a format example in prose
        "function f() { return {a: 1}; }",
        'Config:\n```json\n{"a":2,"b":1}\n```\nUse it.',
        '{"ratio":0.1,"total":1234567.25}',
        "{not json at all}",
    ],
)
def test_pc004_leaves_alone(text: str) -> None:
    assert _flagged("PC004", text) == []


def test_data_content_is_canonical_so_never_flagged() -> None:
    data = {"b": [1.0, 2.5, {"z": "café", "a": None}], "a": -0.0}
    assert lint(Prompt([Segment("system", data, "cfg", "static")])) == []


def test_spans_cover_every_value_a_rule_found() -> None:
    text = "Ids: 550e8400-e29b-41d4-a716-446655440000 and d41d8cd98f00b204e9800998ecf8427e."
    assert _flagged("PC002", text) == [
        "550e8400-e29b-41d4-a716-446655440000",
        "d41d8cd98f00b204e9800998ecf8427e",
    ]
    crlf = "one\r\ntwo  \nthree\r\n"
    (ws,) = _findings(crlf)
    assert ws.rule == "PC006" and ws.spans == ((3, 4), (16, 17))  # CRs first


def test_whole_prompt_rules_span_the_whole_segment() -> None:
    p = Prompt([Segment("user", "Q", "q", "dynamic"), Segment("system", "Rules.", "s", "static")])
    (f,) = lint(p)
    assert f.rule == "PC005" and f.spans == ((0, 6),)


def test_json_nested_too_deep_is_skipped_not_a_crash() -> None:
    for text in ["[" * 5000 + "]" * 5000, "Data: " + '{"a":' * 3000]:
        assert _flagged("PC004", text) == []
