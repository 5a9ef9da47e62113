"""The paper's integration claim, held for every registered policy: < 50 lines of code."""

import ast
import inspect
import io
import tokenize

import pytest

from sgl_vtoken.policies import POLICIES

MAX_CODE_LINES = 50


def code_lines(source: str) -> int:
    """Lines carrying code: docstrings, comments and blank lines do not count."""
    doc_lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                doc_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    skip = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    }
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(r for r in range(tok.start[0], tok.end[0] + 1) if r not in doc_lines)
    return len(lines)


def test_counter_ignores_docstrings_and_comments():
    src = '"""Module doc\nline 2."""\n\n# comment\nx = 1  # trailing\n\ndef f():\n    """Doc."""\n    return x\n'
    assert code_lines(src) == 3


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_module_is_under_50_code_lines(name):
    module = inspect.getmodule(POLICIES[name])
    n = code_lines(inspect.getsource(module))
    assert n < MAX_CODE_LINES, f"{module.__name__} has {n} code lines (limit {MAX_CODE_LINES})"
