"""front/json_values.separators: the commas outside strings, counted on the bytes, equal the separators
of the parsed document, for any JSON (strings full of quotes, backslashes and commas included)."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from service.front.json_values import separators

tricky_text = st.text(alphabet=st.sampled_from(['"', "\\", ",", "a", "é", "\n", "[", "}"]), max_size=12)
documents = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | tricky_text,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(tricky_text, inner, max_size=6),
    max_leaves=40,
)


def walked(doc) -> int:
    """The separators of a parsed document: n - 1 for each non-empty array or object of n."""
    if isinstance(doc, list):
        return max(len(doc) - 1, 0) + sum(walked(v) for v in doc)
    if isinstance(doc, dict):
        return max(len(doc) - 1, 0) + sum(walked(v) for v in doc.values())
    return 0


@settings(max_examples=300, deadline=None)
@given(documents, st.booleans())
def test_separators_are_those_of_the_parsed_document(doc, ascii_only):
    raw = json.dumps(doc, ensure_ascii=ascii_only).encode()
    assert separators(raw) == walked(doc)


def test_two_million_values_are_counted():
    raw = json.dumps({"inputs": [{"name": "text", "data": ["a,\\\"b"] * 2_000_000}]}).encode()
    assert separators(raw) == (2_000_000 - 1) + 1  # the data's, and the one between the tensor's two members
