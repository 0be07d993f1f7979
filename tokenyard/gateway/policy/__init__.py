"""The routing policy of record: state in force, versions in Redis. The admin work and API that need the
whole Gateway live above state.py (routes/policy_admin.py, routes/policy_api.py, web/policy_page.py)."""
