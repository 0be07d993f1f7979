"""What requests cost: usage records, the exactly-once ledger, its spool, rollups, reports and budgets
(the spend API and its queries, which need the whole Gateway, live above state.py in routes/)."""
