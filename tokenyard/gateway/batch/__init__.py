"""The Batch API: files (upload, storage, records), batches (records, runner, finalization), where
batch lines run (idle capacity, the bulk pool) and their routes."""
