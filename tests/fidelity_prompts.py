"""The SmolLM2 fidelity prompts: a dozen chat conversations (a long document, the Apache License
2.0, as the system prompt with several questions, multi-turn conversations, no system prompt)
and the answer length. tests/test_real_model.py compares the engine's greedy answers to them
with transformers'; bench/kv_dtype.py and bench/greedy_answers.py measure a KV dtype's quality
on them (issue 28's definition: greedy answers equal the model dtype's)."""

from __future__ import annotations

from pathlib import Path

FULL_TEXT = (
    Path(__file__).resolve().parent.parent / "examples/documents/apache-license-2.0.txt"
).read_text(encoding="utf-8")
# About 900 tokens of it (the title and Sections 2 to 6: the grants, redistribution,
# contributions, trademarks): long enough to span many blocks, short enough that a dozen
# uncached prefills fit the fidelity test's budget.
DOCUMENT = (
    FULL_TEXT[: FULL_TEXT.index("TERMS AND CONDITIONS")]
    + FULL_TEXT[FULL_TEXT.index("2. Grant of Copyright") : FULL_TEXT.index("7. Disclaimer")]
)
SYSTEM = "Answer questions about the document below in one short sentence.\n\n" + DOCUMENT
MAX_NEW_TOKENS = 16

DOCUMENT_QUESTIONS = [
    "Which version of the Apache License is this?",
    "Which rights does the copyright license grant?",
    "When does the patent license terminate?",
    "What must you give recipients of the Work?",
    "What must modified files carry?",
    "Does the License grant permission to use trademarks?",
]
CONVERSATIONS: list[list[dict[str, str]]] = [
    *(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        for q in DOCUMENT_QUESTIONS
    ),
    [  # multi-turn over the document
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which section covers redistribution?"},
        {"role": "assistant", "content": "Section 4, Redistribution."},
        {"role": "user", "content": "Name one of its conditions."},
    ],
    [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Under which terms is a Contribution submitted?"},
        {"role": "assistant", "content": "Under the terms and conditions of this License."},
        {"role": "user", "content": "Can a separate agreement override that?"},
    ],
    [  # multi-turn, no system prompt
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"},
    ],
    [{"role": "user", "content": "What is the capital of France?"}],  # no system prompt
    [{"role": "user", "content": "Write a haiku about bread."}],
    [{"role": "user", "content": "List three colours of the rainbow."}],
]
NUM_SHARED = 8  # the first eight conversations start with SYSTEM
