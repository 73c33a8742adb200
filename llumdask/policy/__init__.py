"""Dispatch, migration-pairing and scaling policies: small pure functions behind registries."""
