"""A StructuredOutput as xgrammar's compiled grammar: what a compile worker runs
(engine/grammar_child.py), and the layout and error text the router's parse shares
(engine/grammar.py parse_grammar).
"""
from __future__ import annotations

import json
import re
from typing import Any

from pdwire.structured_output import GrammarKind, StructuredOutput

# JSON is held to one layout, `{"a": 1, "b": [2, 3]}` (json.dumps' own): free whitespace lets a
# small or unsure model spend its whole max_tokens on tabs and newlines (vLLM's
# disable-any-whitespace, for the same reason); strict JSON output reads the same to every parser.
JSON_LAYOUT = dict(any_whitespace=False)


def compile_spec(xgr: Any, compiler: Any, spec: StructuredOutput) -> Any:
    """`spec` compiled by `compiler` (an xgrammar GrammarCompiler). Raises ValueError for a
    grammar that does not compile."""
    try:
        if spec.kind is GrammarKind.JSON_SCHEMA:
            return compiler.compile_grammar(_json_ebnf(xgr, spec.spec))
        if spec.kind is GrammarKind.JSON_OBJECT:
            return compiler.compile_json_schema('{"type": "object"}', **JSON_LAYOUT)
        if spec.kind is GrammarKind.REGEX:
            return compiler.compile_regex(spec.spec)
        if spec.kind is GrammarKind.CHOICE:
            return compiler.compile_regex("|".join(_regex_literal(s) for s in json.loads(spec.spec)))
        return compiler.compile_grammar(spec.spec)
    except Exception as err:    # noqa: BLE001 -- xgrammar raises RuntimeError and its own types
        raise library_error(spec, err) from err


def library_error(spec: StructuredOutput, err: Exception) -> ValueError:
    """xgrammar's message without its log prefix ("[12:00:00] /project/cpp/x.cc:94: ")."""
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(err).strip())
    return ValueError(f"invalid {spec.kind.value}: {text[:300]}")


# xgrammar (0.2.9) spells a length-bounded JSON string's characters as [^"\\\r\n], which lets raw
# control characters (U+0000-U+001F) through, and no JSON parser takes those: the grammar's text
# is mended to exclude them, as its unbounded strings already do.
_BOUNDED_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\]'


def _json_ebnf(xgr: Any, schema: str) -> str:
    """The schema's grammar as EBNF text, bounded strings mended (see above)."""
    return str(xgr.Grammar.from_json_schema(schema, **JSON_LAYOUT)).replace(_BOUNDED_STRING_CHARS, _JSON_STRING_CHARS)


_REGEX_SPECIAL = set("\\.^$|?*+()[]{}")
_REGEX_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _regex_literal(text: str) -> str:
    """A regex group matching exactly `text`."""
    return "(" + "".join(_REGEX_ESCAPES.get(c) or ("\\" + c if c in _REGEX_SPECIAL else c) for c in text) + ")"
