"""Test support that outside tests can use too: a worker pool, reference models, parity
runs against a non-sharded model and FSDP2, and exact collective/storage accounting."""
