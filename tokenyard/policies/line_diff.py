"""A unified diff of two lists of lines whose cost is bounded, for version diffs of policies.

    unified_diff(before, after, "version 3", "version 4")     # "" when equal

difflib.unified_diff is fine for the usual edit but has quadratic (and worse) cases: one side
long, the other under 200 lines made of the same few lines (its "popular line" junking only
starts at 200), ran for minutes on a 17 KB policy. Here the common head and tail are cut off
first (linear; an edit usually touches a few lines in the middle), difflib matches only what is
left, and only while len(middle before) x len(middle after) stays under `max_pairs`; past that,
the middle is shown as removed and added whole. Still a correct unified diff (patch applies it),
just not a minimal one, and only for changes nobody reads line by line anyway.
"""
from __future__ import annotations

import difflib
from collections.abc import Iterator, Sequence

MAX_PAIRS = 250_000          # about 500 x 500 changed lines: milliseconds for difflib
CONTEXT = 3

Opcode = tuple[str, int, int, int, int]


def unified_diff(before: Sequence[str], after: Sequence[str], old_label: str, new_label: str,
                 context: int = CONTEXT, max_pairs: int = MAX_PAIRS) -> str:
    """Lines keep their own line endings (splitlines(keepends=True)), as with difflib."""
    if list(before) == list(after):
        return ""
    out = [f"--- {old_label}\n", f"+++ {new_label}\n"]
    for group in _groups(_opcodes(before, after, max_pairs), context):
        first, last = group[0], group[-1]
        out.append(f"@@ -{_range(first[1], last[2])} +{_range(first[3], last[4])} @@\n")
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                out.extend(" " + line for line in before[i1:i2])
                continue
            out.extend("-" + line for line in before[i1:i2])
            out.extend("+" + line for line in after[j1:j2])
    return "".join(out)


def _opcodes(a: Sequence[str], b: Sequence[str], max_pairs: int) -> list[Opcode]:
    head = 0
    while head < len(a) and head < len(b) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < len(a) - head and tail < len(b) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    a_end, b_end = len(a) - tail, len(b) - tail
    ops: list[Opcode] = [("equal", 0, head, 0, head)] if head else []
    if (a_end - head) * (b_end - head) <= max_pairs:
        matcher = difflib.SequenceMatcher(None, a[head:a_end], b[head:b_end])
        ops += [(tag, i1 + head, i2 + head, j1 + head, j2 + head) for tag, i1, i2, j1, j2 in matcher.get_opcodes()]
    else:
        tag = "replace" if a_end > head and b_end > head else ("delete" if a_end > head else "insert")
        ops.append((tag, head, a_end, head, b_end))
    if tail:
        ops.append(("equal", a_end, len(a), b_end, len(b)))
    return _merge_equal(ops)


def _merge_equal(ops: list[Opcode]) -> list[Opcode]:
    out: list[Opcode] = []
    for op in ops:
        if op[1] == op[2] and op[3] == op[4]:
            continue
        if out and op[0] == "equal" and out[-1][0] == "equal":
            prev = out.pop()
            op = ("equal", prev[1], op[2], prev[3], op[4])
        out.append(op)
    return out


def _groups(ops: list[Opcode], n: int) -> Iterator[list[Opcode]]:
    """Hunks: the changes with up to n lines of context, as difflib's get_grouped_opcodes."""
    codes = list(ops) or [("equal", 0, 1, 0, 1)]
    if codes[0][0] == "equal":
        tag, i1, i2, j1, j2 = codes[0]
        codes[0] = tag, max(i1, i2 - n), i2, max(j1, j2 - n), j2
    if codes[-1][0] == "equal":
        tag, i1, i2, j1, j2 = codes[-1]
        codes[-1] = tag, i1, min(i2, i1 + n), j1, min(j2, j1 + n)
    group: list[Opcode] = []
    for tag, i1, i2, j1, j2 in codes:
        if tag == "equal" and i2 - i1 > 2 * n:
            group.append((tag, i1, min(i2, i1 + n), j1, min(j2, j1 + n)))
            yield group
            group = []
            i1, j1 = max(i1, i2 - n), max(j1, j2 - n)
        group.append((tag, i1, i2, j1, j2))
    if group and not (len(group) == 1 and group[0][0] == "equal"):
        yield group


def _range(start: int, stop: int) -> str:
    """difflib's unified range: "start,length" (1-based; length 1 is just start; empty at start-1)."""
    beginning, length = start + 1, stop - start
    if length == 1:
        return str(beginning)
    if not length:
        beginning -= 1
    return f"{beginning},{length}"
