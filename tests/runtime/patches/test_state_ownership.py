"""A request's eviction state is written only by the module of each concern (the table is in
docs/design/splice.md, "Request state").

The parts are `ReqEvictState`, every class of `patches/` its fields are annotated with, and the
records in `RECORDS` (a radix node's `node.vt`, a recall plan); a part's owner is the module that
defines it. The lint: an attribute assignment (plain, augmented, annotated, or one target of a
tuple, list or starred target) whose attribute is a field of a part fails in any module but the
part's owner; other modules change a part through its methods. Fields are told apart by name
only, so no two owners may have a field of the same name (checked too). The attributes that
hang the state on SGLang's objects (`ATTACHED`) are set by one module each, likewise."""

import ast
from pathlib import Path

PATCHES = Path(__file__).resolve().parents[3] / "patches"
RECORDS = ("NodeRecord", "RecallPlan")
ATTACHED = {
    "vtoken": "runtime",
    "vt": "history",
}  # req.vtoken (a ReqEvictState), node.vt (a NodeRecord)


def files() -> dict[str, Path]:
    """Module name -> file, for every module of patches/ and its subpackages (names are unique)."""
    found = {p.stem: p for p in sorted(PATCHES.rglob("*.py")) if p.stem != "__init__"}
    assert len(found) == len([p for p in PATCHES.rglob("*.py") if p.stem != "__init__"]), (
        "two modules share a name"
    )
    return found


def sources() -> dict[str, str]:
    """Module name -> source of every module of patches/."""
    return {name: path.read_text() for name, path in files().items()}


def _is_report(target: ast.expr) -> bool:
    """`report` (the field): its record's figures share names with the server's counters, so
    it is held by its own rule: only `core/report.py` writes `<x>.report.<figure>`."""
    return isinstance(target, ast.Name) and target.id == "report"


def _is_protocol(cls: ast.ClassDef) -> bool:
    """A Protocol declares what a part's users need; its fields are the part class's."""
    return any(isinstance(b, ast.Name) and b.id == "Protocol" for b in cls.bases)


def parts_table(src: str) -> dict[str, str]:
    """`core/state.py`'s `PARTS` (field -> class of a part typed `Any` or by a Protocol there),
    read from the AST."""
    for node in ast.parse(src).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "PARTS":
            return ast.literal_eval(node.value)
    raise AssertionError("core/state.py has no PARTS table")


def test_every_part_typed_any_is_in_the_parts_table():
    """A part a leaf module cannot import is typed `Any` or by a Protocol and named in `PARTS`,
    so the lint sees its class; every `PARTS` class exists in `patches/`."""
    srcs = sources()
    table = parts_table(srcs["state"])
    body = ast.parse(srcs["state"]).body
    composer = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == "ReqEvictState")
    protocols = {n.name for n in body if isinstance(n, ast.ClassDef) and _is_protocol(n)}
    untyped = {
        s.target.id
        for s in composer.body
        if isinstance(s, ast.AnnAssign) and ast.unparse(s.annotation) in {"Any", *protocols}
    }
    assert untyped == set(table)
    defined = {
        n.name for src in srcs.values() for n in ast.parse(src).body if isinstance(n, ast.ClassDef)
    }
    assert set(table.values()) <= defined


def owners(srcs: dict[str, str]) -> dict[str, str]:
    """Field name of a part -> the module owning that part."""
    classes = {
        node.name: (module, node)
        for module, src in srcs.items()
        for node in ast.parse(src).body
        if isinstance(node, ast.ClassDef)
    }
    composer = classes["ReqEvictState"][1]
    named = {
        n.id
        for stmt in composer.body
        if isinstance(stmt, ast.AnnAssign) and not _is_report(stmt.target)
        for n in ast.walk(stmt.annotation)
        if isinstance(n, ast.Name)
    } | set(parts_table(srcs["state"]).values())
    fields = dict(ATTACHED)
    for name in sorted({"ReqEvictState", *RECORDS} | (named & classes.keys())):
        module, cls = classes[name]
        if _is_protocol(cls):
            continue
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                owner = fields.setdefault(stmt.target.id, module)
                assert owner == module, (
                    f"{name}.{stmt.target.id}: {owner}.py has a part field of that name"
                )
    return fields


def assigned_attributes(tree: ast.AST):
    """Every `x.attr` an assignment in `tree` writes."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            stack = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            stack = [node.target]
        else:
            continue
        while stack:
            target = stack.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                stack.extend(target.elts)
            elif isinstance(target, ast.Starred):
                stack.append(target.value)
            elif isinstance(target, ast.Attribute):
                yield target


def violations(srcs: dict[str, str]) -> list[str]:
    fields, found, where = owners(srcs), [], files()
    for module, src in srcs.items():
        for target in assigned_attributes(ast.parse(src)):
            if isinstance(target.value, ast.Name) and target.value.id == "self":
                continue  # a class writing its own fields (a part's methods live with its owner)
            reported = isinstance(target.value, ast.Attribute) and target.value.attr == "report"
            owner = "report" if reported else fields.get(target.attr)
            if owner is not None and owner != module:
                found.append(
                    f"{where[module].relative_to(PATCHES.parent)}:{target.lineno}: {ast.unparse(target)} "
                    f"(owned by {owner}.py)"
                )
    return sorted(found)


def test_no_module_writes_another_modules_state():
    assert violations(sources()) == []


def test_the_lint_catches_planted_writes_and_spares_the_owner():
    srcs = sources()
    srcs["eviction"] += (
        "\n\ndef _planted(st, node, plan):\n"
        "    st.row.offset += 1\n"
        "    n, (st.prefix.hit, *st.naive.held) = 1, (None,)\n"
        "    node.vt.live: int = 0\n"
        "    plan.scores = None\n"
        "    node.vt = None\n"
        "    st.report.evicted_tokens = 0\n"
    )
    srcs["row"] += "\n\ndef _own(st):\n    st.row.offset = 0\n"
    found = violations(srcs)
    assert [f.split(": ", 1)[1] for f in found] == [
        "st.row.offset (owned by row.py)",
        "st.naive.held (owned by held.py)",
        "st.prefix.hit (owned by prefix.py)",
        "node.vt.live (owned by history.py)",
        "plan.scores (owned by host_recall.py)",
        "node.vt (owned by history.py)",
        "st.report.evicted_tokens (owned by report.py)",
    ]
    assert all(f.startswith("patches/step/eviction.py:") for f in found)


def test_every_part_has_its_owner():
    fields = owners(sources())
    assert {
        f: fields[f]
        for f in (
            "row",
            "kept_pos",
            "accumulator",
            "hit",
            "held",
            "stash",
            "logical",
            "chunks",
            "pinned",
            "candidates",
            "live",
            "view",
        )
    } == {
        "row": "state",
        "kept_pos": "row",
        "accumulator": "scores",
        "hit": "prefix",
        "held": "held",
        "stash": "retraction",
        "logical": "prefill",
        "chunks": "host_tier",
        "pinned": "host_recall",
        "candidates": "host_recall",
        "live": "history",
        "view": "history",
    }
