"""The routing policy of record: state in force, versions in Redis, admin work, admin API and page."""
