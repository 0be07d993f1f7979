"""PolicyError: every problem found in a policy document, each with its place and key path.

Validation keeps going after the first problem so an operator fixes a document in one pass;
the gateway refuses the whole document (the running policy stays) and shows this list.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Problem:
    """One thing wrong with a document.

    line and column are 1-based (as editors count) and None when the problem has no place in
    the text (a policy built in code). path is the key path, e.g. "rules[2].match.prompt_tokens.max".
    """

    path: str
    message: str
    line: int | None = None
    column: int | None = None
    allowed: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = f"line {self.line}, column {self.column}: " if self.line is not None else ""
        key = f"{self.path}: " if self.path else ""
        hint = f" (allowed: {', '.join(self.allowed)})" if self.allowed else ""
        return f"{where}{key}{self.message}{hint}"

    def to_dict(self) -> dict:
        """JSON shape for the admin API and the operator page."""
        return {"path": self.path, "message": self.message, "line": self.line,
                "column": self.column, "allowed": list(self.allowed)}


class PolicyError(ValueError):
    """An invalid policy: .problems lists all of them, in document order."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = list(problems)
        count = len(self.problems)
        head = f"invalid policy: {count} problem{'s' if count != 1 else ''}"
        super().__init__(head + "".join(f"\n  - {p}" for p in self.problems))

    def to_dict(self) -> dict:
        return {"problems": [p.to_dict() for p in self.problems]}
