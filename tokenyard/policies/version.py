"""Policy versions: the record the gateway stores for each applied policy, built by pure functions.

The gateway keeps these in Redis and broadcasts the new number by pub/sub; this module only
says what a version is and how the next one is made, so PUT /admin/policy, rollback and
history are a few lines there:

    v = next_version(history[-1] if history else None, text, author="ops-admin", applied_at=now)
    v = rollback_to(history, 3, author="ops-admin", applied_at=now)   # a new version, old content

A rollback is a new version whose document is the old one's, so history only ever grows and
the audit trail shows who rolled back and when. The stored document is the text as applied
(comments kept for the next editor); the hash is over the canonical form, so a rollback has
exactly the hash of the version it restores.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .errors import PolicyError, Problem
from .export import diff, policy_hash
from .schema import Policy
from .validation import load_policy


@dataclass(slots=True, frozen=True)
class PolicyVersion:
    version: int                 # 1, 2, 3, ... per deployment
    hash: str                    # policy_hash of the document: identity of the meaning
    author: str                  # the admin key's name that applied it
    applied_at: datetime         # UTC
    document: str                # the YAML as applied
    diff: str                    # unified diff of the canonical YAML from the previous version
    note: str = ""               # e.g. "rollback to version 3"

    def policy(self) -> Policy:
        return load_policy(self.document)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "hash": self.hash, "author": self.author,
                "applied_at": self.applied_at.isoformat(), "document": self.document, "diff": self.diff,
                "note": self.note}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PolicyVersion:
        return cls(version=int(d["version"]), hash=str(d["hash"]), author=str(d["author"]),
                   applied_at=datetime.fromisoformat(d["applied_at"]), document=str(d["document"]),
                   diff=str(d["diff"]), note=str(d.get("note", "")))


def next_version(previous: PolicyVersion | None, document: str, author: str, applied_at: datetime,
                 note: str = "") -> PolicyVersion:
    """Validate `document` and make the version after `previous`. Raises PolicyError when invalid
    (the running version stays). Applying a document that means the same as the previous one is
    allowed and gives an empty diff; the caller may refuse it as a no-op."""
    new = load_policy(document)
    old = previous.policy() if previous is not None else None
    number = previous.version + 1 if previous is not None else 1
    label_old = f"version {previous.version}" if previous is not None else "(none)"
    return PolicyVersion(version=number, hash=policy_hash(new), author=author, applied_at=applied_at,
                         document=document, diff=diff(old, new, label_old, f"version {number}"), note=note)


def rollback_to(history: list[PolicyVersion], version: int, author: str, applied_at: datetime) -> PolicyVersion:
    """A new version restoring `version`'s document exactly."""
    if not history:
        raise PolicyError([Problem("version", "there is no policy history to roll back")])
    target = next((v for v in history if v.version == version), None)
    if target is None:
        raise PolicyError([Problem("version", f"no version {version}",
                                   allowed=tuple(str(v.version) for v in history))])
    latest = max(history, key=lambda v: v.version)
    return next_version(latest, target.document, author, applied_at, note=f"rollback to version {version}")
