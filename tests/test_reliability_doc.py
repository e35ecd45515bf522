"""docs/reliability.md stays true: every rejected-input row names a test file
that matches the row's message, and there are at least 25 rows."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rows():
    with open(os.path.join(ROOT, "docs", "reliability.md")) as doc:
        text = doc.read()
    table = text.split("## Rejected inputs", 1)[1].split("## Faults", 1)[0]
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].isdigit():
            yield cells


def test_every_rejected_input_row_has_a_test_matching_its_message():
    found = list(rows())
    assert len(found) >= 25
    assert [int(r[0]) for r in found] == list(range(1, len(found) + 1))
    for number, area, what, error, message, test_file in found:
        with open(os.path.join(ROOT, test_file)) as source:
            text = source.read()
        # The doc writes the message as the test's source does (a regex).
        assert message in text, f"row {number} ({what}): {test_file} does not match {message!r}"
        assert re.search(rf"\b{error}\b", text), f"row {number}: {test_file} does not expect {error}"
