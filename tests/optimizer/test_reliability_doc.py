"""docs/reliability.md stays true: every rejected-input row names the test that
refuses its input, and that test expects the row's error and message.

A row's last cell names a test node, `tests/FILE.py::FUNCTION` (without
parametrization; FUNCTION may also be a function a test runs elsewhere, such
as a case of tests/distributed_cases.py). The check reads that function and
needs a `pytest.raises(ERROR, match=MATCH)` in it, or in a module-level
function or table it names, whose ERROR is the row's error class and whose
MATCH contains the row's message excerpt. The excerpt is written as in a
Python string literal, backslashes doubled (the rendered table shows the regex
itself). ERROR and MATCH may be literals, or names the function takes from its
`pytest.mark.parametrize` values or unpacks from a module-level table (a dict
or list literal, or a function returning one).
"""

import ast
import os

import pytest
from conftest import ROOT



def rows():
    with open(os.path.join(ROOT, "docs", "reliability.md")) as doc:
        text = doc.read()
    table = text.split("## Rejected inputs", 1)[1].split("## Faults", 1)[0]
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].isdigit():
            yield cells


def text_of(node):
    """A string literal's value; an f-string's with each placeholder as {}."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)
    return None


def class_name(node):
    """ValueError for `ValueError`, OutOfMemoryError for `torch.OutOfMemoryError`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def table_entries(node, module):
    """The entries of a table: a list, tuple or dict literal, or a name bound
    at module level to one, or a call of a module-level function returning
    one, or `list(...)` of any of these (a dict's entries are its values)."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return node.elts
    if isinstance(node, ast.Dict):
        return node.values
    if isinstance(node, ast.Subscript):
        return table_entries(node.value, module)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id == "list" and node.args:
            return table_entries(node.args[0], module)
        definition = module.get(node.func.id)
        if isinstance(definition, ast.FunctionDef):
            returns = [n.value for n in ast.walk(definition) if isinstance(n, ast.Return) and n.value is not None]
            return [entry for value in returns for entry in table_entries(value, module)]
    if isinstance(node, ast.Name) and isinstance(module.get(node.id), ast.Assign):
        return table_entries(module[node.id].value, module)
    return []


def bindings(function, module):
    """Each set of values the function's names can take: one per parametrize
    row, one per entry of a table unpacked into a tuple of names."""
    sources = []  # (names, entries)
    for decorator in function.decorator_list:
        if isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", None) == "parametrize":
            argnames = decorator.args[0]
            names = ([text_of(n) for n in argnames.elts] if isinstance(argnames, (ast.List, ast.Tuple))
                     else [n.strip() for n in text_of(argnames).split(",")])
            sources.append((names, table_entries(decorator.args[1], module)))
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple):
            names = [getattr(n, "id", None) for n in node.targets[0].elts]
            sources.append((names, table_entries(node.value, module)))
    found = [{}]
    for names, entries in sources:
        for entry in entries:
            if isinstance(entry, ast.Call) and getattr(entry.func, "attr", None) == "param":  # pytest.param(...)
                entry = ast.Tuple(elts=entry.args)
            values = entry.elts if isinstance(entry, ast.Tuple) else [entry]
            if len(values) == len(names):
                found.append(dict(zip(names, values)))
    return found


def reach(function, module):
    """The function and the module-level functions and tables it names, transitively."""
    seen, todo = {}, [function]
    while todo:
        node = todo.pop()
        for name in {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} - seen.keys():
            if name in module:
                seen[name] = module[name]
                todo.append(module[name])
    return [function] + list(seen.values())


def expected_refusals(path, function_name):
    """(error class, match text) of every pytest.raises in reach of the function."""
    with open(os.path.join(ROOT, path)) as source:
        tree = ast.parse(source.read())
    module = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            module[node.name] = node
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            module[node.targets[0].id] = node
    function = module.get(function_name)
    assert isinstance(function, ast.FunctionDef), f"{path} has no function {function_name}"
    out = set()
    for scope in reach(function, module):
        if not isinstance(scope, ast.FunctionDef):
            continue
        names = bindings(scope, module)
        for call in ast.walk(scope):
            if not (isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "raises" and call.args):
                continue
            match = next((k.value for k in call.keywords if k.arg == "match"), None)
            for bound in names:
                error = bound.get(getattr(call.args[0], "id", None), call.args[0])
                text = text_of(bound.get(getattr(match, "id", None), match))
                if class_name(error) and text is not None:
                    out.add((class_name(error), text))
    return out


def test_every_rejected_input_row_names_a_test_expecting_its_error_and_message():
    found = list(rows())
    assert len(found) >= 25
    assert [int(r[0]) for r in found] == list(range(1, len(found) + 1))
    for number, area, what, error, message, node in found:
        path, _, function_name = node.partition("::")
        refusals = expected_refusals(path, function_name)
        regex = message.replace("\\\\", "\\")
        assert any(e == error and regex in m for e, m in refusals), (
            f"row {number} ({what}): {node} has no pytest.raises({error}, match=...) containing {regex!r}; "
            f"it has {sorted(refusals)}")


def test_the_check_accepts_only_what_the_named_function_expects():
    """Negative controls on the suite's own tests: another test's message, the
    wrong error class and a missing function are not accepted."""
    combine = expected_refusals("tests/optimizer/test_validation.py", "test_config_and_fields_combine")
    assert ("TypeError", "SwapOptimizerConfig") in combine
    assert not any("swap_times must be" in match for _, match in combine)  # test_bad_config_values' message
    layout = expected_refusals("tests/kernels/test_layout_errors.py", "test_bad_call_is_refused_before_any_write")
    assert ("TypeError", "grads must have the param's dtype") in layout
    assert ("ValueError", "grads must have the param's dtype") not in layout
    with pytest.raises(AssertionError, match="has no function test_no_such_test"):
        expected_refusals("tests/optimizer/test_validation.py", "test_no_such_test")
