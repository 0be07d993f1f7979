"""What requests cost: usage records, the exactly-once ledger, its spool, rollups, reports, budgets
and the spend API."""
